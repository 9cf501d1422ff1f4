"""Per-request grammar state: one xgrammar `GrammarMatcher` per slot, and the
step's token bitmask.

API (slots are the runner's request slots; the sampling state drives it, a
speculative-decoding runner may call it directly):

- `add(slot, params)` / `remove(slot)`: a request with `structured_outputs`
  (its grammar compiled by the engine) enters / leaves its slot.
- `sync(slots, token_ids, num_prompt_tokens, num_tokens)`: advance each
  matcher with the output tokens it has not seen (rows of `token_ids` hold
  prompt then output, as the runner keeps them). Called before each fill, so
  the grammar follows exactly the tokens the request kept — with synchronous
  or asynchronous scheduling, and after a preemption (the slot keeps its
  matcher and its count). Returns {slot: error} for a token the grammar
  refuses (the bitmask was not applied); that request should fail.
- `accept(slot, tokens) -> bool`: advance one slot by accepted tokens (what
  `sync` does per slot); False, and nothing advanced, if one is refused.
- `rollback(slot, n)`: undo the last `n` accepted tokens.
- `fill_bitmask(slots, draft_tokens_per_row=None) -> (bitmask, rows)`: int32
  [N, ceil(V/32)] (bit 1 = allowed), filled with xgrammar's batched matcher
  for the slots that have a grammar. Without drafts N = len(slots) and
  `rows` are the batch rows that have a grammar (other rows' masks are all
  ones). With `draft_tokens_per_row[i]` (k_i draft tokens of batch row i),
  row i owns k_i + 1 consecutive masks: the mask before each draft token and
  after the last; each draft token is accepted tentatively to fill the next
  mask, then all are rolled back (`matcher.rollback`), so the state is
  unchanged. A draft token the grammar refuses leaves the masks after it all
  ones (the rejection sampler rejects that token: its probability is 0).
  The verified tokens then go in through `accept` (or `sync`). The bitmask
  is a reused host buffer: valid until the next call.

A matcher that has accepted EOS (terminated) takes no further token and its
masks allow EOS only: the output stays what the grammar accepted (with
ignore_eos the request runs on to its length on EOS tokens, which the text
leaves out; asynchronous scheduling's one token past a stop is dropped
anyway). EOS itself is allowed only where the grammar may end.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from polyrunner.structured.params import StructuredOutputsParams


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """Grammar matchers of the running requests, one per slot."""

    def __init__(self, num_slots: int, vocab_size: int) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self.matchers: dict[int, Any] = {}
        self.num_accepted = np.zeros(num_slots, np.int64)   # output tokens each matcher has taken
        # xgrammar's batched fill, on up to half the host's cores (the other half runs the step)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
        self._buf = torch.full((0, self.width), -1, dtype=torch.int32)
        self._stop_rows: dict[tuple[int, ...], torch.Tensor] = {}

    # ---- requests -------------------------------------------------------------
    def add(self, slot: int, params: StructuredOutputsParams) -> None:
        compiled = params.compiled
        if compiled is None:
            raise ValueError("structured_outputs was not compiled: requests with structured outputs must "
                             "be admitted by the engine (LLMEngine.add_request)")
        if compiled.tokenizer_info.vocab_size != self.vocab_size:
            raise ValueError(f"structured_outputs grammar was compiled for a vocabulary of "
                             f"{compiled.tokenizer_info.vocab_size} tokens; the model has {self.vocab_size}")
        self.matchers[slot] = self._xgr.GrammarMatcher(compiled)
        self.num_accepted[slot] = 0

    def remove(self, slot: int) -> None:
        self.matchers.pop(slot, None)
        self.num_accepted[slot] = 0

    def has_grammar(self, slots: np.ndarray) -> np.ndarray:
        """bool [len(slots)]: which slots have a matcher."""
        if not self.matchers:
            return np.zeros(len(slots), bool)
        return np.isin(slots, np.fromiter(self.matchers, np.int64, len(self.matchers)))

    # ---- advancing --------------------------------------------------------------
    def accept(self, slot: int, tokens: list[int] | np.ndarray) -> bool:
        """Advance `slot` by `tokens`; False (nothing advanced) if the grammar refuses one.
        A terminated matcher ignores further tokens (True)."""
        m = self.matchers[slot]
        taken = 0
        for t in np.asarray(tokens, np.int64).tolist():
            if m.is_terminated():
                break
            if not m.accept_token(t):
                if taken:
                    m.rollback(taken)
                return False
            taken += 1
        self.num_accepted[slot] += len(tokens)
        return True

    def rollback(self, slot: int, n: int) -> None:
        """Undo the last `n` accepted tokens of `slot`."""
        if n > 0:
            self.matchers[slot].rollback(n)
            self.num_accepted[slot] -= n

    def sync(self, slots: np.ndarray, token_ids: np.ndarray, num_prompt_tokens: np.ndarray,
             num_tokens: np.ndarray) -> dict[int, str]:
        """Feed each grammar slot the output tokens it has not taken yet (placeholders
        of tokens still on the device, < 0, end the run). {slot: error} for refusals."""
        errors: dict[int, str] = {}
        for slot in slots[self.has_grammar(slots)].tolist():
            start = int(num_prompt_tokens[slot]) + int(self.num_accepted[slot])
            new = token_ids[slot, start:int(num_tokens[slot])]
            if new.size and (new < 0).any():
                new = new[:int(np.argmax(new < 0))]
            if new.size and not self.accept(slot, new):
                errors[slot] = (f"structured output: the grammar refused token(s) {new.tolist()} after "
                                f"{int(self.num_accepted[slot])} output tokens (was the token bitmask applied?)")
                self.matchers.pop(slot)   # it cannot follow the request any further
        return errors

    # ---- masks ------------------------------------------------------------------
    def _buffer(self, n: int) -> torch.Tensor:
        if self._buf.shape[0] < n:
            self._buf = torch.full((max(n, 2 * self._buf.shape[0]), self.width), -1, dtype=torch.int32)
        buf = self._buf[:n]
        buf.fill_(-1)
        return buf

    def _stop_only(self, matcher: Any) -> torch.Tensor:
        """The mask row allowing only the matcher's stop tokens (EOS), cached."""
        stops = tuple(sorted(matcher.stop_token_ids))
        row = self._stop_rows.get(stops)
        if row is None:
            ids = np.array(stops, np.int64)
            words = np.zeros(self.width, np.uint32)
            np.bitwise_or.at(words, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
            row = self._stop_rows[stops] = torch.from_numpy(words.view(np.int32))
        return row

    def fill_bitmask(self, slots: np.ndarray, draft_tokens_per_row: list[list[int]] | None = None
                     ) -> tuple[torch.Tensor, np.ndarray]:
        """(bitmask [N, W] int32 on the host, mask rows that have a grammar); see the module doc."""
        slots = np.asarray(slots, np.int64)
        grammar = self.has_grammar(slots)
        if draft_tokens_per_row is None:
            bitmask = self._buffer(len(slots))
            rows = np.flatnonzero(grammar)
            live, done = [], []
            for r in rows.tolist():
                (done if self.matchers[int(slots[r])].is_terminated() else live).append(r)
            if live:
                self._batch.batch_fill_next_token_bitmask(
                    [self.matchers[int(slots[r])] for r in live], bitmask, live)
            for r in done:
                bitmask[r] = self._stop_only(self.matchers[int(slots[r])])
            return bitmask, rows
        if len(draft_tokens_per_row) != len(slots):
            raise ValueError(f"draft_tokens_per_row must have one list per slot ({len(slots)}), "
                             f"got {len(draft_tokens_per_row)}")
        counts = np.array([len(d) + 1 for d in draft_tokens_per_row], np.int64)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        bitmask = self._buffer(int(counts.sum()))
        rows: list[int] = []
        for i in np.flatnonzero(grammar).tolist():
            m = self.matchers[int(slots[i])]
            taken = 0
            for j, token in enumerate([*draft_tokens_per_row[i], None]):
                rows.append(int(starts[i]) + j)
                if m.is_terminated():
                    bitmask[rows[-1]] = self._stop_only(m)
                    break
                m.fill_next_token_bitmask(bitmask, rows[-1])
                if token is None or not m.accept_token(int(token)):
                    break
                taken += 1
            if taken:
                m.rollback(taken)
        return bitmask, np.asarray(rows, np.int64)
