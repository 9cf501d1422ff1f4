"""Numpy mirror of the scheduler's running requests, for the all-decode fast path.

Row i describes `running[i]`. Built from the requests' attributes, then
advanced in place by the fast path (one token per row per step) and compacted
when rows finish, so the common decode step checks progress, block room and
stop conditions with array operations instead of per-request Python. Anything
else that touches the running requests makes the scheduler drop and rebuild it.
"""

from __future__ import annotations

import numpy as np

from polyrunner.engine.request import Request


class RunningArrays:
    def __init__(self, reqs: list[Request], blocks: dict[str, list[int]], block_size: int,
                 max_model_len: int) -> None:
        """Snapshot of `reqs` (in order) and the blocks they hold."""
        n = len(reqs)
        self.num_computed = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, n)
        num_prompt = np.fromiter((len(r.prompt_token_ids) for r in reqs), np.int64, n)
        num_tokens = num_prompt + np.fromiter((len(r.output_token_ids) for r in reqs), np.int64, n)
        self.capacity = np.fromiter((len(blocks.get(r.request_id, ())) for r in reqs), np.int64, n) * block_size
        # every row has exactly one token to compute (num_tokens == num_computed + 1);
        # the fast path keeps it so, and then tracks num_computed only
        self.all_decoding = bool((num_tokens - self.num_computed == 1).all())
        # a row whose num_computed reaches `last` (so num_tokens reaches max_tokens
        # output tokens or max_model_len) ends by length
        max_tokens = np.fromiter((r.max_tokens for r in reqs), np.int64, n)
        self.last = np.minimum(num_prompt + max_tokens, max_model_len) - 1
        stop: set[int] = set()
        for r in reqs:
            if not r.params.ignore_eos:
                stop |= r.eos_token_ids
            stop.update(r.params.stop_token_ids or ())
        # token id -> may stop some row (`check_stop` decides); larger ids map to the
        # last entry, which is False
        self.stop_table = np.zeros(max(stop, default=-1) + 2, bool)
        self.stop_table[list(stop)] = True

    def __len__(self) -> int:
        return len(self.num_computed)

    def may_stop(self, tokens: np.ndarray) -> np.ndarray:
        """Rows (all decoding) whose newest token, `tokens` (one per row, already
        counted), might end them: a length limit, or a stop/EOS id of some row.
        A superset of the rows `Scheduler.check_stop` finishes."""
        out = self.num_computed >= self.last
        table = self.stop_table
        if len(table) > 1:
            out |= table[np.minimum(tokens, len(table) - 1)]
        return np.flatnonzero(out)

    def extend(self, other: "RunningArrays") -> None:
        """Append `other`'s rows (requests that joined `running` after these)."""
        for name in ("num_computed", "capacity", "last"):
            setattr(self, name, np.concatenate([getattr(self, name), getattr(other, name)]))
        self.all_decoding = self.all_decoding and other.all_decoding
        if len(other.stop_table) > len(self.stop_table):
            self.stop_table, other.stop_table = other.stop_table, self.stop_table
        self.stop_table[:len(other.stop_table) - 1] |= other.stop_table[:-1]

    def keep(self, mask: np.ndarray) -> None:
        """Drop the rows where `mask` is False (finished requests)."""
        for name in ("num_computed", "capacity", "last"):
            setattr(self, name, getattr(self, name)[mask])
