"""What one step passes between the scheduler and the runner, in one place.

The scheduler makes a `SchedulerOutput` (the rows to run, block-id deltas, the
requests entering their slots, the slots whose requests finished since the last
step); the runner consumes it and answers with a `ModelRunnerOutput` by batch row.
Neither side reaches into the other: the runner learns that a request finished
only from `SchedulerOutput.finished_slots`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from polyrunner.engine.request import Request
    from polyrunner.lora.request import LoRARequest
    from polyrunner.sampling_params import SamplingParams


@dataclass
class NewRequest:
    """A request entering its slot for the first time: what the runner keeps."""

    request_id: str
    slot: int
    prompt_token_ids: list[int]
    params: "SamplingParams"
    eos_token_ids: frozenset[int]
    bad_words_token_ids: list[list[int]] | None = None
    lora_request: "LoRARequest | None" = None


NO_ROWS = np.zeros(0, np.int32)
NO_ROWS.flags.writeable = False


@dataclass
class SchedulerOutput:
    """One step. Rows are the scheduled requests, decodes (one token) first.

    `slots[i]` is row i's slot (the runner's `idx_mapping`); it computes
    `num_scheduled[i]` tokens from position `num_computed[i]` (int64 arrays,
    read-only for consumers); `samples[i]`: its sampled token counts. Block ids come as
    deltas per slot: `new_block_ids[slot]` extends the slot's table, after the
    table is emptied for slots in `reset_block_slots` (new or resumed requests).
    """

    requests: "list[Request]" = field(default_factory=list)
    slots: np.ndarray = field(default_factory=lambda: NO_ROWS)
    num_scheduled: np.ndarray = field(default_factory=lambda: NO_ROWS)
    num_computed: np.ndarray = field(default_factory=lambda: NO_ROWS)
    new_requests: list[NewRequest] = field(default_factory=list)
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)
    reset_block_slots: list[int] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    # slots of the requests that finished (or were aborted) since the last step: the runner
    # drops their state before it adds this step's new requests (a slot may be reused at once)
    finished_slots: list[int] = field(default_factory=list)
    samples: np.ndarray = field(default_factory=lambda: NO_ROWS)   # [R] bool: the row completes its
    #   sequence and its sampled token counts (else a partial prefill, its sample is dropped)
    num_finished_at_schedule: int = 0   # the scheduler's finished count when this step was made
    # speculative decoding, None when no row has drafts this step: [R] draft tokens scheduled
    # (the last ones of the row's num_scheduled), [R, k] their ids (the first num_draft_tokens[i])
    num_draft_tokens: np.ndarray | None = None
    draft_token_ids: np.ndarray | None = None
    removed_loras: list[int] = field(default_factory=list)   # adapter ids the runners drop (remove_lora)

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def total_num_tokens(self) -> int:
        return int(self.num_scheduled.sum())

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner: no rows and no finished slots to drop."""
        return not self.requests and not self.finished_slots and not self.removed_loras


LogprobRow = tuple[list[int], list[float], int]   # token ids, logprobs, rank of the first


@dataclass
class ModelRunnerOutput:
    """One step's results, by batch row of the scheduler output."""

    tokens: np.ndarray                                   # [R] int64; rows that ran a partial prefill: ignore
    logprobs: dict[str, LogprobRow] = field(default_factory=dict)               # req_id -> sampled token's
    prompt_logprobs: dict[str, list[LogprobRow]] = field(default_factory=dict)  # req_id -> this step's chunk
    errors: dict[int, str] = field(default_factory=dict)  # batch row -> why its request failed (own code)
    # speculative decoding (None without it): [R, k + 1] tokens per row, -1 after the
    # first num_sampled[i] (accepted drafts, then the sampled token); the drafts proposed
    # for each row's next step, [R, k] and their counts [R]
    sampled_token_ids: np.ndarray | None = None
    num_sampled: np.ndarray | None = None
    draft_token_ids: np.ndarray | None = None
    num_draft_tokens: np.ndarray | None = None
