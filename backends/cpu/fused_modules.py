"""The CPU backend's fused modules: RMSNorm (also fused with the residual add before it), the
rotary embedding (in place) and `silu(gate) * up`, each one C++ pass (`fused_elementwise.cpp`),
for bfloat16 (Hugging Face's exact roundings) and float32 models; the "rms_norm", "rotary" and
"gated_mlp" op overrides (`op_overrides.py`). Anything else (another dtype, mixed dtypes, an odd
shape or layout) runs the module they replace.
"""

from __future__ import annotations

import torch
from torch import nn

from polyrunner.backends.cpu import kernels
from polyrunner.plugin_api import RMSNormOverride

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _fused(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors together: one dtype, float32 or bfloat16."""
    return tensors[0].dtype in FUSED_DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)


class FusedRMSNorm(RMSNormOverride):
    """Hugging Face RMSNorm (normalise in float32, scale in the model's dtype) as one C++ pass."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _fused(x, self.weight) or x.shape[-1] != self.weight.shape[0]:
            return self.inner(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return kernels.rms_norm(x2, self.weight, self.eps).view(shape)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)` in one C++ pass."""
        if not _fused(x, residual, self.weight) or x.shape != residual.shape or x.shape[-1] != self.weight.shape[0]:
            residual = x + residual
            return self(residual), residual
        shape = x.shape
        out, r = kernels.add_rms_norm(x.reshape(-1, shape[-1]).contiguous(),
                                      residual.reshape(-1, shape[-1]).contiguous(), self.weight, self.eps)
        return out.view(shape), r.view(shape)


class FusedMLP(nn.Module):
    """gate_up -> silu(gate) * up (one C++ pass) -> down."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj
        self.intermediate = mlp.intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        shape = gu.shape
        if not _fused(gu):
            gate, up = gu.split(self.intermediate, dim=-1)
            return self.down_proj(torch.nn.functional.silu(gate) * up)
        h = kernels.silu_mul(gu.reshape(-1, shape[-1]))
        return self.down_proj(h.view(*shape[:-1], self.intermediate))


class FusedRotary(nn.Module):
    """Rotary embedding applied in place by one C++ pass (HF roundings in bfloat16)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.inner = rotary

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.inner.cos, self.inner.sin
        D = q.shape[-1]
        if (not _fused(q, k) or D % 2 or D > 512
                or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous())
                or q.stride(-1) != 1 or q.stride(-2) != D or k.stride(-1) != 1 or k.stride(-2) != D):
            return self.inner(positions, q, k)
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        kernels.rotary_(positions, q, k, cos, sin)
        return q, k
