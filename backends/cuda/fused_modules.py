"""The CUDA backend's fused modules, each keeping its role's call and attributes
(`polyrunner.ops.ROLES`): RMSNorm (also with the residual add), the rotary embedding (in place)
and the gated MLP's `silu(gate) * up`, each one Triton kernel (`triton_norm.py`,
`triton_rotary.py`, `triton_activation.py`); the "rms_norm", "rotary" and "gated_mlp" op
overrides (`op_overrides.py`). What the norm or rotary kernel does not take (another dtype, shape
or layout) runs the module it wraps. Importing this module imports triton.
"""

from __future__ import annotations

import torch
from torch import nn

from polyrunner.backends.cuda import triton_norm, triton_rotary
from polyrunner.backends.cuda.triton_activation import silu_and_mul
from polyrunner.plugin_api import RMSNormOverride


class TritonRMSNorm(RMSNormOverride):
    """RMSNorm (`forward`, `forward_add`) as one Triton pass; keeps `weight` and `eps`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not triton_norm.supported(x, self.weight):
            return self.inner(x)
        return triton_norm.rms_norm(x, self.weight, self.eps)[0]

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)` in one Triton pass."""
        if x.shape != residual.shape or x.dtype != residual.dtype or not triton_norm.supported(x, self.weight):
            residual = x + residual
            return self(residual), residual
        out, total = triton_norm.rms_norm(x, self.weight, self.eps, residual)
        assert total is not None
        return out, total


class TritonRotary(nn.Module):
    """The rotary embedding applied in place by one Triton kernel over the wrapped module's
    cos/sin tables (`cos`, `sin`)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.inner = rotary

    @property
    def cos(self) -> torch.Tensor:
        return self.inner.cos

    @property
    def sin(self) -> torch.Tensor:
        return self.inner.sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.inner.cos, self.inner.sin
        if not triton_rotary.supported(q, k, cos, sin) or positions.shape != (q.shape[0],):
            return self.inner(positions, q, k)
        triton_rotary.rotary_(positions, q, k, cos, sin)
        return q, k


class TritonGatedMLP(nn.Module):
    """gate_up_proj -> silu(gate) * up (one Triton kernel) -> down_proj; keeps `gate_up_proj`,
    `down_proj` and `intermediate`."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj
        self.intermediate = mlp.intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
