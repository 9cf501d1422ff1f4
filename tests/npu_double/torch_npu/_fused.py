"""The fused elementwise ops of the torch_npu double (signatures from the Ascend Extension for
PyTorch API reference, "torch_npu.npu_*" pages), computed as documented, in float32 where the
device does."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_npu._op import op
from torch_npu._rules import require


@op()
def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor): RmsNorm
    over the last dims of gamma's rank, computed in float32: (y, rstd), rstd with the normalised dims kept as 1."""
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (gamma * (x * rstd).to(self.dtype)).to(self.dtype), rstd


@op()
def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_npu.npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (y, rstd, x):
    x = x1 + x2, then RmsNorm of x (vllm-ascend's AscendRMSNorm with a residual)."""
    x = x1 + x2
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (gamma * (xf * rstd).to(x.dtype)).to(x.dtype), rstd, x


@op()
def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
                   ) -> torch.Tensor:
    """torch_npu.npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half'): 4-D input,
    r1 (cos) and r2 (sin) broadcastable to it; "half": input * r1 + rotate_half(input) * r2."""
    require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul takes 4-D tensors",
            "torch_npu.npu_rotary_mul")
    require(rotary_mode == "half", f"the double implements rotary_mode 'half', got {rotary_mode!r}",
            "torch_npu double")
    half = input.shape[-1] // 2
    rotated = torch.cat((-input[..., half:], input[..., :half]), dim=-1)
    return input * r1 + rotated * r2


@op()
def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch_npu.npu_swiglu(Tensor input, int dim=-1): input split in two halves a, b along dim ->
    silu(a) * b (computed in float32, returned in input's dtype)."""
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)
