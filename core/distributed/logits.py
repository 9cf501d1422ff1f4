"""Whole-vocabulary logits from a vocabulary-parallel LM head."""

from __future__ import annotations

from typing import Any, Callable

import torch


class GatherLogits:
    """Wraps a backend's `GraphExecutor`: `compute_logits` returns `[N, vocab]` on
    every rank (each rank computes its vocabulary range; an all-gather joins
    them), so every rank samples the same tokens from the same logits. Every
    other member reads through to the wrapped executor."""

    def __init__(self, inner: Any, gather_vocab: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner = inner
        self.gather_vocab = gather_vocab

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def compute_logits(self, hidden: torch.Tensor, inputs: Any, num_reqs: int) -> torch.Tensor:
        return self.gather_vocab(self.inner.compute_logits(hidden, inputs, num_reqs))
