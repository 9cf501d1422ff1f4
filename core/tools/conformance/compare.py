"""Numerical agreement: how close the backend's output must be to a reference,
by the dtype the model runs in, and where greedy tokens may part from it."""

from __future__ import annotations

from typing import Any

import torch

# max |a - b| <= TOL * max(1, max |reference|), by the dtype the model runs in.
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, 5e-2)


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float, float]:
    """(agree, max |got - ref|, allowed bound); a shape mismatch or a non-finite value never agrees."""
    got, ref = got.float(), ref.float()
    if got.shape != ref.shape:
        return False, float("inf"), 0.0
    bound = tolerance(dtype) * max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    return bool(torch.isfinite(got).all()) and err <= bound, err, bound


# Greedy tokens in a low-precision dtype may part from the reference where its top-1 and top-2
# logprobs are nearly tied: another summation order (a device kernel, two ranks) can swap them.
# A divergence is excused only where the reference's gap is below the margin (nats); float32
# runs compare token for token. Measured on the tiny Llama through the torch_npu double: bfloat16
# divergences at gaps of 0.008 and 0.016 nats; float16 keeps 3 more mantissa bits.
TIE_MARGIN = {torch.float32: 0.0, torch.float16: 0.05, torch.bfloat16: 0.1}


def tie_margin(dtype: torch.dtype) -> float:
    return TIE_MARGIN.get(dtype, 0.1)


def first_divergence(got: list[int], ref: list[int]) -> int | None:
    """The first output index where `got` and `ref` differ (a length difference counts), or None."""
    at = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    return None if at == len(got) == len(ref) else at


def top2_gap(logprobs: dict[int, Any]) -> float:
    """top-1 minus top-2 logprob of one position's logprobs ({token: Logprob}); inf with one entry."""
    values = sorted((lp.logprob for lp in logprobs.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def excused(at: int, ref_logprobs: list[dict[int, Any]] | None, dtype: torch.dtype) -> float | None:
    """The reference's top-2 gap at divergence `at` when it is a near-tie the dtype excuses, else None."""
    if ref_logprobs is None or at >= len(ref_logprobs):
        return None
    gap = top2_gap(ref_logprobs[at])
    return gap if gap < tie_margin(dtype) else None
