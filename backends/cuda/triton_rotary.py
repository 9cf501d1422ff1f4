"""Triton rotary embedding, in place on q and k (the "rotary" role).

Reads the core's float32 cos/sin tables `[max_positions, D]` (rotate_half layout: the two halves
of a row are equal, so only the first is read) at each token's position; any scaling (linear,
llama3) is already in the tables. With x1, x2 the halves of a head, writes
x1 * cos - x2 * sin and x2 * cos + x1 * sin, with Hugging Face's roundings: the table values
and each product rounded to q's dtype, then the sum. q `[T, Hq, D]` and k `[T, Hkv, D]` are
addressed through their strides (they may be views of one qkv projection). Grid
`(T, head blocks)`: a program rotates HEADS query heads and HEADS key heads of one token.
Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ELEMENTS = 1024   # elements a program aims for (HEADS * HALF per tensor)


@triton.jit
def _rotate(ptr, token, heads, n_heads, s_t, s_h, s_d, half, c, s, HALF: tl.constexpr):
    """Rotate heads `heads` (masked to n_heads) of one token in place; c, s: [HALF_PAD] in q's dtype, as float32."""
    d = tl.arange(0, HALF)
    mask = (heads < n_heads)[:, None] & (d < half)[None, :]
    base = ptr + token * s_t + heads.to(tl.int64)[:, None] * s_h
    p1 = base + d[None, :] * s_d
    p2 = base + (d[None, :] + half) * s_d
    dt = ptr.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    x1c = (x1 * c[None, :]).to(dt).to(tl.float32)
    x2c = (x2 * c[None, :]).to(dt).to(tl.float32)
    x1s = (x1 * s[None, :]).to(dt).to(tl.float32)
    x2s = (x2 * s[None, :]).to(dt).to(tl.float32)
    tl.store(p1, (x1c - x2s).to(dt), mask=mask)
    tl.store(p2, (x2c + x1s).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, n_q, n_k, half,
                   q_st, q_sh, q_sd, k_st, k_sh, k_sd, cos_sp, cos_sd, sin_sp, sin_sd,
                   HEADS: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF)
    dt = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * cos_sp + d * cos_sd, mask=d < half, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * sin_sp + d * sin_sd, mask=d < half, other=0.0).to(dt).to(tl.float32)
    _rotate(q_ptr, token, heads, n_q, q_st, q_sh, q_sd, half, c, s, HALF)
    _rotate(k_ptr, token, heads, n_k, k_st, k_sh, k_sd, half, c, s, HALF)


def launch_shape(n_q: int, n_k: int, D: int) -> tuple[int, int]:
    """(HEADS, HALF) of the kernel for n_q query and n_k key heads of size D."""
    half_pad = triton.next_power_of_2(D // 2)
    return min(triton.next_power_of_2(max(n_q, n_k)), max(1, _ELEMENTS // half_pad)), half_pad


def supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary_` takes these: q `[T, Hq, D]`, k `[T, Hkv, D]` of one float dtype, D even,
    float32 tables `[P, D]`."""
    D = q.shape[-1] if q.dim() == 3 else 0
    return (q.dim() == 3 and k.dim() == 3 and D > 0 and D % 2 == 0 and k.shape[0] == q.shape[0]
            and k.shape[-1] == D and q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and cos.dtype == sin.dtype == torch.float32 and cos.dim() == sin.dim() == 2
            and cos.shape[-1] == sin.shape[-1] == D)


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> None:
    """Rotate q and k in place at `positions` `[T]` (int32/int64, each < the tables' rows);
    `supported(q, k, cos, sin)`. No host synchronisation (graph-safe)."""
    T, n_q, D = q.shape
    n_k = k.shape[1]
    if T == 0:
        return
    heads, half_pad = launch_shape(n_q, n_k, D)
    grid = (T, triton.cdiv(max(n_q, n_k), heads))
    _rotary_kernel[grid](q, k, cos, sin, positions, n_q, n_k, D // 2, *q.stride(), *k.stride(), *cos.stride(),
                         *sin.stride(), HEADS=heads, HALF=half_pad, num_warps=4)
