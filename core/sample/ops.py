"""Sampling operations on a [R, V] float32 logits tensor (pure torch, any device).

Functions named `apply_*` return the processed tensor; they write in place
only into tensors they were explicitly told they own (`inplace=True`).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


# ---- logits processors (before greedy argmax) ------------------------------
def mask_pairs(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Set logits[rows[j], ids[j]] = -inf, in place."""
    logits[rows, ids] = NEG_INF
    return logits


def add_logit_bias(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                   values: torch.Tensor) -> torch.Tensor:
    """logits[rows[j], ids[j]] += values[j], in place ((row, id) pairs are unique)."""
    logits.index_put_((rows, ids), values, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, prompt_mask: torch.Tensor,
                    output_counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties on `rows`, in place (vLLM semantics).

    repetition: a token seen in the prompt or the output has a positive logit
    divided by the penalty and a non-positive one multiplied by it;
    frequency/presence: `logit -= frequency * count + presence * (count > 0)`
    over output counts only.
    """
    sub = logits[rows]
    output_mask = output_counts > 0
    seen = prompt_mask | output_mask
    rep = torch.where(seen, repetition.unsqueeze(1), torch.ones_like(sub))
    sub = torch.where(sub > 0, sub / rep, sub * rep)
    sub = sub - frequency.unsqueeze(1) * output_counts.to(sub.dtype)
    sub = sub - presence.unsqueeze(1) * output_mask.to(sub.dtype)
    logits[rows] = sub
    return logits


# ---- random-sampling filters (after greedy argmax) -------------------------
def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) every token outside top-k, then outside top-p. Returns a new tensor.

    Tokens are ranked by a *stable* descending sort, so ties are broken by the
    lower token id: exactly min(k, V) tokens survive top-k. Top-p is applied to
    the distribution renormalised over the top-k survivors (as HF and vLLM do)
    and keeps the smallest rank prefix whose mass reaches p: a token stays iff
    the mass of the tokens ranked above it is < p. Rows with k >= V or p >= 1
    are untouched; the best token always stays.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits.masked_fill_(ranks.unsqueeze(0) >= top_k.unsqueeze(1), NEG_INF)
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_above = torch.cumsum(probs, dim=-1)
        mass_above = torch.cat([torch.zeros_like(mass_above[:, :1]), mass_above[:, :-1]], dim=1)
        remove = (mass_above >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1.0)
        remove[:, 0] = False
        sorted_logits.masked_fill_(remove, NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def min_p_mask(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """True where a prob is below min_p * the max prob of its row. The probabilities
    need not be normalised: the test is a ratio to the max."""
    return probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero (in place) every prob below min_p * max prob of its row."""
    return probs.masked_fill_(min_p_mask(probs, min_p), 0.0)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  default_generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from (unnormalised) probs: argmax(probs / q), q ~ Exp(1).

    Rows in `generators` draw their q (V values) from their own generator, so
    their stream does not depend on the rest of the batch; the other rows share
    one draw from `default_generator` (the engine's). A zero-probability token is
    never chosen (q is clamped away from 0, so 0 / q = 0 < p / q).
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_(generator=default_generator)
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)
