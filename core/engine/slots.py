"""Stable request slots and the scheduler's per-slot arrays.

A request takes the lowest free slot when first admitted and keeps it until it
finishes (also while preempted). The arrays below are indexed by slot and are
the one home of the facts they hold, so the scheduler decides a whole step with
array operations:

- `num_computed`: tokens whose KV is in the cache (`Request.num_computed_tokens`
  reads and writes it);
- `num_tokens`: prompt + output tokens, counting from `schedule()` on the token
  a step will sample (a placeholder until `update()` appends it);
- `length_limit`: `num_tokens` at which the request ends by length
  (max_tokens output tokens, or max_model_len);
- `stop_table`: token id -> "may stop some request" (EOS unless ignore_eos, and
  stop_token_ids), a superset filter for `Scheduler.check_stop`;
- `num_blocks`: KV blocks the request holds (more than cdiv(num_computed,
  block_size) after rejected draft tokens were rolled back);
- `num_drafts`, `draft_ids`: speculative decoding's draft tokens proposed for the
  request's next step (`num_speculative_tokens` columns; none without it).
"""

from __future__ import annotations

import heapq

import numpy as np

from polyrunner.engine.request import Request


class SlotArrays:
    def __init__(self, num_slots: int, max_model_len: int, num_speculative_tokens: int = 0) -> None:
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self._free = list(range(num_slots))   # a heap: the lowest free slot first
        self.num_computed = np.zeros(num_slots, np.int64)
        self.num_tokens = np.zeros(num_slots, np.int64)
        self.length_limit = np.zeros(num_slots, np.int64)
        self.stop_table = np.zeros(1, bool)   # ids past the end map to the last entry (False)
        self.num_blocks = np.zeros(num_slots, np.int64)
        self.num_drafts = np.zeros(num_slots, np.int64)
        self.draft_ids = np.zeros((num_slots, num_speculative_tokens), np.int64)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def assign(self, req: Request) -> int:
        """Give `req` the lowest free slot; its progress starts at 0."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} request slots are taken")
        slot = heapq.heappop(self._free)
        req.attach(slot, self.num_computed)
        self.num_computed[slot] = self.num_blocks[slot] = self.num_drafts[slot] = 0
        self.num_tokens[slot] = req.num_tokens
        self.length_limit[slot] = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        stops = set(req.params.stop_token_ids or ())
        if not req.params.ignore_eos:
            stops |= req.eos_token_ids
        if stops:
            top = max(stops) + 2
            if top > len(self.stop_table):
                grown = np.zeros(top, bool)
                grown[:len(self.stop_table) - 1] = self.stop_table[:-1]
                self.stop_table = grown
            self.stop_table[list(stops)] = True
        return slot

    def release(self, req: Request) -> None:
        """Free the request's slot (it holds none afterwards)."""
        if not req.holds_slot:
            return
        assert req.slot is not None   # set with its progress by `assign`
        heapq.heappush(self._free, req.slot)
        req.detach()
        if len(self._free) == self.num_slots:
            self.stop_table = np.zeros(1, bool)   # nobody left: forget old stop ids

    def may_stop(self, slots: np.ndarray, tokens: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
        """Indices into `slots` whose newest token (`tokens`; `num_tokens` counts it)
        might end the request: its length limit, or a stop/EOS id of some request."""
        out = num_tokens >= self.length_limit[slots]
        table = self.stop_table
        if len(table) > 1:
            out |= table[np.minimum(tokens, len(table) - 1)]
        return np.flatnonzero(out)
