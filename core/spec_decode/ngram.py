"""N-gram (prompt-lookup) proposer, vectorised over the batch.

For each request, the trailing n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`, longest first) are looked up in its earlier prompt +
output tokens; at the last earlier occurrence, the (up to) k tokens that
followed it are the drafts. No match: no drafts."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min must be in [1, prompt_lookup_max={prompt_lookup_max}] "
                             f"(got {prompt_lookup_min})")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, slots: np.ndarray, num_tokens: np.ndarray,
                max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """See `Proposer.propose`."""
        k = self.num_speculative_tokens
        R = len(slots)
        drafts = np.zeros((R, k), np.int64)
        counts = np.zeros(R, np.int64)
        want = np.flatnonzero((max_drafts > 0) & (num_tokens > self.min_n))
        if not want.size:
            return drafts, counts
        n_tok = num_tokens[want].astype(np.int64)
        L = int(n_tok.max())
        seq = token_ids[slots[want], :L].astype(np.int64)           # [W, L]
        seq = np.where(np.arange(L) < n_tok[:, None], seq, -1)     # past the end: no token matches
        rows = np.arange(len(want))
        start = np.full(len(want), -1, np.int64)                   # where the drafts start, -1: none yet
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):   # longest n-gram first
            open_ = start < 0
            if not open_.any():
                break
            tail = seq[rows[:, None], n_tok[:, None] - n + np.arange(n)]          # [W, n]
            windows = sliding_window_view(seq, n, axis=1)                       # [W, L-n+1, n]
            match = (windows == tail[:, None, :]).all(axis=2)
            match &= np.arange(match.shape[1]) < (n_tok - n)[:, None]         # earlier occurrences only
            match &= (n_tok > n)[:, None]
            last = match.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)
            found = match[rows, last] & open_
            start[found] = last[found] + n
        hit = np.flatnonzero(start >= 0)
        if not hit.size:
            return drafts, counts
        cols = start[hit, None] + np.arange(k)                           # [H, k]
        num = np.minimum(n_tok[hit] - start[hit], np.minimum(k, max_drafts[want[hit]]))
        drafts[want[hit]] = seq[hit[:, None], np.minimum(cols, L - 1)]
        counts[want[hit]] = num
        return drafts, counts
