"""Triton SiLU-and-mul: `silu(gate) * up` of `[..., 2I]` (gate then up) -> `[..., I]` (the
"gated_mlp" role's activation).

Hugging Face's roundings: silu in float32 rounded to the input dtype, times up, rounded once
more. Rows are read through their stride (the columns must be contiguous). Grid
`(rows, column blocks)` of BLOCK columns. Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 2048   # columns per program


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, x_sr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dt = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_sr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_sr + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (act * up).to(dt), mask=mask)


def launch_shape(inter: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the kernel for `inter` output columns."""
    block = min(MAX_BLOCK, triton.next_power_of_2(inter))
    return block, 4 if block >= 512 else 1


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of x `[..., 2I]` (a float dtype): a new contiguous
    `[..., I]` tensor in x's dtype. No host synchronisation (graph-safe)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate then up), got {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out.numel() == 0:
        return out
    block, warps = launch_shape(inter)
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](x2, out, inter, x2.stride(0), BLOCK=block,
                                                                 num_warps=warps)
    return out
