"""Triton RMSNorm, alone or with the residual add before it (the "rms_norm" role).

Hugging Face's roundings in one pass: the sum `x + residual` is rounded to the input dtype (and
written in it), normalised in float32, rounded to the input dtype, then scaled by the weight in
float32 and rounded once to the output dtype (the promotion of weight and input, as the
reference's `weight * x`). A program owns ROWS rows of BLOCK = next_power_of_2(H) columns; rows
are addressed as `[A, B, H]` with two row strides, so a strided view (a q/k norm on the qkv
projection) is read in place. Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 16384   # widest row one program holds in registers (wider spills): wider rows are not supported
_ELEMENTS = 2048    # elements a program aims for (ROWS * BLOCK), 8 per thread at 256 threads


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, out_ptr, sum_ptr, w_ptr, n_rows, B, H, x_sa, x_sb, r_sa, r_sb, eps,
                     ADD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    a = (rows // B).to(tl.int64)
    b = (rows % B).to(tl.int64)
    x = tl.load(x_ptr + (a * x_sa + b * x_sb)[:, None] + cols[None, :], mask=mask, other=0.0)
    dense = rows.to(tl.int64)[:, None] * H + cols[None, :]   # the outputs are contiguous [n_rows, H]
    if ADD:
        r = tl.load(r_ptr + (a * r_sa + b * r_sb)[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + dense, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)
    y = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(out_ptr + dense, (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[A, B, H]` with unit column stride: a view when its strides allow, else a copy."""
    if x.dim() == 1:
        x = x.unsqueeze(0)
    x3 = x.unsqueeze(0) if x.dim() == 2 else x.reshape(-1, x.shape[-2], x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def launch_shape(H: int, n_rows: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps) of the kernel for rows of H columns, n_rows of them."""
    block = triton.next_power_of_2(H)
    rows = min(max(1, _ELEMENTS // block), triton.next_power_of_2(n_rows))
    return rows, block, min(16, max(4, rows * block // 256))


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes `x` (a float dtype, last dim the weight's, at most MAX_BLOCK wide)."""
    return (x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.dim() >= 1 and weight.dim() == 1
            and x.shape[-1] == weight.shape[0] and 0 < weight.shape[0] <= MAX_BLOCK)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(s), s) with s = x + residual (rounded to x's dtype), or (norm(x), None) without a
    residual; `x` and `residual` of one shape and dtype, `supported(x, weight)`. The outputs are
    new contiguous tensors of x's shape: the norm in promote(weight, x), the sum in x's dtype."""
    H = x.shape[-1]
    shape = x.shape
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    x3 = _rows(x)
    r3 = _rows(residual) if residual is not None else x3
    total = torch.empty(shape, dtype=x.dtype, device=x.device) if residual is not None else out
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows == 0:
        return out, (total if residual is not None else None)
    rows, block, warps = launch_shape(H, n_rows)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x3, r3, out, total, weight, n_rows, x3.shape[1], H, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        eps, ADD=residual is not None, ROWS=rows, BLOCK=block, num_warps=warps)
    return out, (total if residual is not None else None)
