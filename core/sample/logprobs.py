"""Logprobs of sampled (or given) tokens plus the top-k alternatives.

Format (vLLM's): row i holds the chosen token first, then the k most likely
tokens; `ranks[i]` is the rank of the chosen token in the distribution
(1 = best; ties count only strictly greater logprobs, so tied tokens share a
rank). k = -1 means the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Protocol

import torch


class HostCopy(Protocol):
    """A device->host copy in flight (a backend's `HostFuture`)."""

    def result(self) -> torch.Tensor: ...


@dataclass
class LogprobsLists:
    """Host-side logprobs: plain Python lists, one entry per row."""

    token_ids: list[list[int]]   # [R][k+1]
    logprobs: list[list[float]]  # [R][k+1]
    ranks: list[int]             # [R]

    # tuple-style access too: token_ids, logprobs, ranks = lists
    def __iter__(self):
        return iter((self.token_ids, self.logprobs, self.ranks))

    def __getitem__(self, i: int):
        return (self.token_ids, self.logprobs, self.ranks)[i]

    def row(self, i: int, num_logprobs: int | None = None) -> tuple[list[int], list[float], int]:
        """Row i trimmed to `num_logprobs` alternatives (None or -1: keep all)."""
        end = None if num_logprobs is None or num_logprobs < 0 else num_logprobs + 1
        return self.token_ids[i][:end], self.logprobs[i][:end], self.ranks[i]

    def rows(self) -> list[tuple[list[int], list[float], int]]:
        """Every row, untrimmed."""
        return [self.row(i) for i in range(len(self.ranks))]


@dataclass
class LogprobsTensors:
    """Device-side logprobs of one step."""

    token_ids: torch.Tensor  # [R, k+1] int64: chosen token, then the top-k
    logprobs: torch.Tensor   # [R, k+1] float32
    ranks: torch.Tensor      # [R] int64, rank of the chosen token (1 = best)

    def tolists(self) -> LogprobsLists:
        """Copy to the host (a synchronisation point)."""
        return LogprobsLists(
            self.token_ids.cpu().tolist(),
            self.logprobs.cpu().tolist(),
            self.ranks.cpu().tolist(),
        )

    def to_host_async(self, copy: Callable[[torch.Tensor], HostCopy]) -> LogprobsFuture:
        """Start the copies with `copy` (the backend's `to_host_async`) and return at once;
        the future's `result()` waits for them and gives what `tolists()` gives."""
        return LogprobsFuture(self, (copy(self.token_ids), copy(self.logprobs), copy(self.ranks)))


@dataclass
class LogprobsFuture:
    """Logprobs on their way to the host; `result()` waits for the copies (once)."""

    tensors: LogprobsTensors | None   # the device tensors (kept alive until the copies land)
    copies: tuple[HostCopy, HostCopy, HostCopy]
    _lists: LogprobsLists | None = None

    def result(self) -> LogprobsLists:
        if self._lists is None:
            assert self.tensors is not None
            ids, lps, ranks = (c.result() for c in self.copies)
            # the same class on host tensors: a subclass's `tolists` (e.g. per-row trimming) still applies
            host = dataclasses.replace(self.tensors, token_ids=ids, logprobs=lps, ranks=ranks)
            self._lists, self.tensors = host.tolists(), None
        return self._lists


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the vocabulary, in float32."""
    return torch.log_softmax(logits.float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, k: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """Chosen token's logprob and rank, plus the top-k (k = -1: all, sorted)."""
    vocab = logprobs.shape[-1]
    if k < 0 or k > vocab:
        k = vocab
    token_ids = token_ids.long().view(-1, 1)
    chosen = logprobs.gather(-1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k == 0:
        return LogprobsTensors(token_ids, chosen, ranks)
    if k == vocab:
        top_lp, top_ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    else:
        top_lp, top_ids = torch.topk(logprobs, k, dim=-1)
    return LogprobsTensors(
        torch.cat([token_ids, top_ids], dim=1),
        torch.cat([chosen, top_lp], dim=1),
        ranks,
    )


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Prompt logprobs: `logits[i]` predicts `target_ids[i]` (the next prompt token).

    Same format as sampled logprobs, with the actual next prompt token in the
    first column; computed from the raw logits.
    """
    return gather_logprobs(compute_logprobs(logits), k, target_ids.to(logits.device))
