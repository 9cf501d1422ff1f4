"""Numerical agreement: how close the backend's output must be to a reference,
by the dtype the model runs in."""

from __future__ import annotations

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
