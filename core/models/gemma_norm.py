"""Gemma's RMSNorm: scale by `1 + weight`, in float32, then cast (Llama casts before scaling).

Not the "rms_norm" role (whose contract and overrides are Llama's): a Gemma model
does not offer these modules for replacement."""

from __future__ import annotations

import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    """`(x / rms(x)) * (1 + weight)` over the last dim, computed in float32, cast to x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`, like `RMSNorm.forward_add`."""
        residual = x + residual
        return self(residual), residual
