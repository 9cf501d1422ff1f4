"""What the runner keeps per request, indexed by the request's slot.

A slot's row is written when its request enters (`add`), extended by the
scheduler's deltas (new block ids) and by the runner's own sampled tokens
(`append`), and dropped when the request finishes (`remove`). Rows never move:
each step gathers its inputs through `idx_mapping` (batch row -> slot).
Progress is not kept here: the scheduler output brings each row's
`num_computed`.
"""

from __future__ import annotations

import numpy as np
import torch

from polyrunner.numeric import cumsum_and_arange
from polyrunner.runner.block_table import BlockTable
from polyrunner.sample import SamplingState
from polyrunner.step_channel import NewRequest, SchedulerOutput


class RequestStates:
    def __init__(self, num_slots: int, max_model_len: int, max_blocks_per_req: int, block_size: int,
                 sampling: SamplingState) -> None:
        self.num_slots = num_slots
        self.token_ids = np.zeros((num_slots, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(num_slots, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(num_slots, dtype=np.int32)
        self.block_table = BlockTable(num_slots, max_blocks_per_req, block_size)
        self.sampling = sampling
        self.req_ids: list[str | None] = [None] * num_slots
        self.lora_id = np.zeros(num_slots, dtype=np.int64)   # the request's adapter id (0: none)
        self.prompt_logprobs_done: dict[int, int] = {}      # slot -> prompt positions returned

    @property
    def num_active(self) -> int:
        return sum(r is not None for r in self.req_ids)

    def add(self, new: NewRequest, generator: torch.Generator | None) -> None:
        """Fill the slot of a request seen for the first time; `generator`: its own
        random stream (seeded requests), kept by the sampling state until it finishes."""
        slot, n = new.slot, len(new.prompt_token_ids)
        if self.req_ids[slot] is not None:
            raise RuntimeError(f"slot {slot} still holds request {self.req_ids[slot]!r}")
        self.token_ids[slot, :n] = new.prompt_token_ids
        self.num_tokens[slot] = self.num_prompt_tokens[slot] = n
        self.block_table.reset_row(slot)
        self.sampling.add_row(slot, new.params, generator, new.bad_words_token_ids,
                              eos_token_ids=new.eos_token_ids)
        self.req_ids[slot] = new.request_id
        self.lora_id[slot] = 0 if new.lora_request is None else new.lora_request.lora_int_id
        if new.params.prompt_logprobs is not None:
            self.prompt_logprobs_done[slot] = 0

    def apply(self, so: SchedulerOutput) -> None:
        """The step's block-id deltas (requests were added before)."""
        table = self.block_table
        for slot in so.reset_block_slots:
            table.reset_row(slot)
        for slot, blocks in so.new_block_ids.items():
            table.append_row(slot, blocks)

    def append(self, slots: np.ndarray, tokens: np.ndarray | int) -> None:
        """One sampled token onto each given (distinct) slot."""
        self.token_ids[slots, self.num_tokens[slots]] = tokens
        self.num_tokens[slots] += 1

    def append_tokens(self, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> None:
        """The first `counts[i]` of `tokens[i]` ([R, m]) onto each given (distinct) slot."""
        rows = np.repeat(np.arange(len(slots)), counts)
        within = cumsum_and_arange(counts)[1]
        token_slots = slots[rows]
        self.token_ids[token_slots, self.num_tokens[token_slots] + within] = tokens[rows, within]
        self.num_tokens[slots] += counts.astype(self.num_tokens.dtype)

    def write_drafts(self, slots: np.ndarray, drafts: np.ndarray, counts: np.ndarray) -> None:
        """Draft tokens after each slot's tokens (the positions a verification step
        computes); `num_tokens` does not move: accepted drafts are appended later."""
        rows = np.repeat(np.arange(len(slots)), counts)
        within = cumsum_and_arange(counts)[1]
        token_slots = slots[rows]
        self.token_ids[token_slots, self.num_tokens[token_slots] + within] = drafts[rows, within]

    def remove(self, slot: int) -> None:
        if self.req_ids[slot] is None:
            return
        self.req_ids[slot] = None
        self.lora_id[slot] = 0
        self.sampling.clear_row(slot)
        self.block_table.reset_row(slot)
        self.prompt_logprobs_done.pop(slot, None)
