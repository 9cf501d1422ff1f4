"""The npu backend's op overrides (`Backend.op_overrides`): torch_npu's fused ops in the roles
"rms_norm", "rotary" and "gated_mlp" (`polyrunner.ops.ROLES`), as vllm-ascend uses them
(vllm_ascend/ops/layernorm.py, rotary_embedding.py, activation.py):

- `NPURMSNorm`: `torch_npu.npu_rms_norm`, and `npu_add_rms_norm` for the residual add;
- `NPURotary`: `torch_npu.npu_rotary_mul` over the role's cos/sin tables (rotate_half layout);
- `NPUGatedMLP`: `torch_npu.npu_swiglu` between the role's two linears.

The modules look torch_npu up when called (sys.modules), so importing this file imports nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from polyrunner.plugin_api import RMSNormOverride

FUSED_DTYPES = (torch.float16, torch.bfloat16)   # the backend's dtypes (limits.py)


def _tnpu() -> Any:
    return sys.modules["torch_npu"]


class NPURMSNorm(RMSNormOverride):
    """RMSNorm (`forward`, `forward_add`) as one torch_npu op; keeps `weight` and `eps`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = _tnpu().npu_rms_norm(x, self.weight, epsilon=self.eps)[0]
        return y

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)` in one `npu_add_rms_norm`."""
        if x.shape != residual.shape or x.dtype != residual.dtype:
            residual = x + residual
            return self(residual), residual
        y, _, total = _tnpu().npu_add_rms_norm(x, residual, self.weight, epsilon=self.eps)
        return y, total


class NPURotary(nn.Module):
    """The rotary embedding by `npu_rotary_mul` ([1, T, heads, D] inputs, [1, T, 1, D] cos/sin) over
    the wrapped module's tables (`cos`, `sin`)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.inner = rotary

    @property
    def cos(self) -> torch.Tensor:
        return cast(torch.Tensor, self.inner.cos)

    @property
    def sin(self) -> torch.Tensor:
        return cast(torch.Tensor, self.inner.sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype)[None, :, None, :]
        sin = self.sin[positions].to(q.dtype)[None, :, None, :]
        rotary_mul = _tnpu().npu_rotary_mul
        return rotary_mul(q[None], cos, sin)[0], rotary_mul(k[None], cos, sin)[0]


class NPUGatedMLP(nn.Module):
    """gate_up_proj -> `npu_swiglu` (silu(gate) * up) -> down_proj; keeps `gate_up_proj`, `down_proj`
    and `intermediate`."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = cast(nn.Module, mlp.gate_up_proj)
        self.down_proj = cast(nn.Module, mlp.down_proj)
        self.intermediate = mlp.intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down_proj(_tnpu().npu_swiglu(self.gate_up_proj(x), dim=-1))
        return y


def npu_op_overrides(dtype: torch.dtype) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """The factories for a model in `dtype` ({} for other dtypes or without torch_npu)."""
    if dtype not in FUSED_DTYPES or "torch_npu" not in sys.modules:
        return {}
    return {"rms_norm": NPURMSNorm, "rotary": NPURotary, "gated_mlp": NPUGatedMLP}
