"""The "rms_norm" role's reference: Hugging Face's RMSNorm, with the residual add fused in."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm over the last dim: normalise in float32, scale by `weight`
    in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: the residual add and the norm in
        one call, so a backend's fused module can do both in one pass."""
        residual = x + residual
        return self(residual), residual


class RMSNormOverride(nn.Module):
    """Base of a backend's "rms_norm" replacement: keeps the role's `weight` and `eps`, and the
    replaced module as `inner` (what a subclass falls back to for inputs its kernel does not take)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.eps)
        self.inner = norm
