"""Engine-side request state: tokens, progress, status, slot.

Progress (`num_computed_tokens`) has one home: while the request holds a slot,
the scheduler's slot-indexed array (`SlotArrays.num_computed`); the request
reads and writes it through the property. Block ids live in the
`KVCacheManager`; the runner keeps device-side copies updated from deltas.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from polyrunner.lora.request import LoRARequest
    from polyrunner.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_FSM = "waiting_for_fsm"   # vLLM's name: its grammar is compiling; not schedulable yet
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"     # its own code failed (e.g. a logits processor raised)

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})


@dataclass(eq=False)
class Request:
    """One sequence being generated. `num_computed_tokens` counts tokens whose
    KV is in the cache; the scheduler schedules `num_tokens - num_computed_tokens`.
    `slot`: the stable index of its per-request state (scheduler and runner),
    held from admission until it finishes (kept across preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    params: "SamplingParams"
    max_tokens: int                      # resolved: params.max_tokens or room left in max_model_len
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0           # prompt tokens served by the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None             # why it ended with FINISHED_ERROR
    num_preemptions: int = 0
    bad_words_token_ids: list[list[int]] | None = None
    slot: int | None = None
    priority: int = 0                    # priority scheduling: lower runs first
    arrival: int = 0                     # arrival order, stamped by the scheduler (ties of priority)
    lora_request: "LoRARequest | None" = None   # the adapter it runs with (None: the base model)
    _progress: np.ndarray | None = field(default=None, repr=False)   # the scheduler's, while slotted

    @property
    def finished(self) -> bool:
        return self.status in _FINISHED

    def attach(self, slot: int, progress: np.ndarray) -> None:
        """Take `slot`; from now on progress lives at `progress[slot]` (the scheduler's array)."""
        self.slot, self._progress = slot, progress

    def detach(self) -> None:
        """Give the slot back; progress reads 0 again."""
        self.slot, self._progress = None, None

    @property
    def holds_slot(self) -> bool:
        return self._progress is not None

    @property
    def num_computed_tokens(self) -> int:
        return 0 if self._progress is None else int(self._progress[self.slot])

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self._progress is None:
            if value:
                raise ValueError(f"request {self.request_id!r} holds no slot: its progress is 0")
            return
        self._progress[self.slot] = value

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def lora_id(self) -> int:
        """Its adapter's id, 0 without one."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id
