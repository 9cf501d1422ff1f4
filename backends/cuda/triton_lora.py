"""The "lora" role's adapter updates in Triton, after vLLM's punica "sgmv" shrink and expand:

    add_lora(y [T, out], x [T, in], lora_a [L, S*R, in], lora_b [L, out, S*R], token_lora [T])
    y[t] += (x[t] @ lora_a[l].T) @ lora_b[l].T,  l = token_lora[t]  (outside [0, L), e.g. -1: nothing)

The tokens are grouped by slot on the device (`lora_groups`: a stable argsort of the slots, the
tokens per slot by a scatter-add, their starts by a cumsum; no host synchronisation, so a CUDA
graph can hold it). Both kernels run on a grid over (slot, token block, column block) sized for
the worst case (every token in one slot); a program whose block lies past its slot's tokens
exits at once. `lora_shrink_kernel` writes `s [T, S*R] = x @ lora_a[l].T` (float32 accumulation,
IEEE dots for float32) for the grouped tokens; `lora_expand_kernel` adds
`s[:, i*R:(i+1)*R] @ lora_b[l, cols, i*R:(i+1)*R].T` to the columns of output slice i (the block
diagonal: zero blocks skipped) with float32 operands ("tf32x3" dots: float32 accuracy on tensor
cores; IEEE dots of these tiles spill registers), into y rounded once. float16, bfloat16 and
float32. Importing this module imports triton.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
EXPAND_BLOCK_N = 64   # output columns per expand program


class LoRALaunch(NamedTuple):
    """The kernels' block sizes for a step: `block_m` tokens per program (both kernels), the
    shrink's `block_n` rows of A and `block_k` input columns, the expand's `block_r` (rank, padded)."""

    block_m: int
    block_n: int
    block_k: int
    block_r: int


def launch_for(tokens: int, ranks: int, in_features: int, rank: int, dtype: torch.dtype) -> LoRALaunch:
    """Blocks for `tokens` rows, `ranks` = S*R rows of A, `rank` = R (tl.dot needs >= 16 each way);
    float32's IEEE shrink dots take K in 32s (64 spills registers at 64 x 64 tiles on sm_90)."""
    return LoRALaunch(16 if tokens <= 64 else 64, min(64, max(16, triton.next_power_of_2(ranks))),
                      64 if in_features >= 64 and dtype != torch.float32 else 32,
                      max(16, triton.next_power_of_2(rank)))


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, s_ptr, order_ptr, counts_ptr, starts_ptr, K, SR,
                       stride_xm, stride_al, stride_an, stride_sm,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """s[tok, n] = x[tok, :K] @ A[slot, n, :K] for the slot's tokens of one M block and N block of S*R."""
    slot = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < SR
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_al + offs_n[None, :] * stride_an + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        a = tl.load(a_ptrs, mask=n_mask[None, :] & (offs_k[:, None] < k_left), other=0.0)
        if IEEE:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    s_ptrs = s_ptr + tokens[:, None] * stride_sm + offs_n[None, :]
    tl.store(s_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def lora_expand_kernel(s_ptr, b_ptr, y_ptr, order_ptr, counts_ptr, starts_ptr, bounds_ptr, R, N_BLOCKS,
                       stride_sm, stride_bl, stride_bn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[tok, c] += s[tok, i*R:(i+1)*R] @ B[slot, c, i*R:(i+1)*R] for the slot's tokens of one M
    block and the columns c of one N block of output slice i (axis 2: i * N_BLOCKS + block)."""
    slot = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    piece = pid_n // N_BLOCKS
    col0 = tl.load(bounds_ptr + piece)
    col1 = tl.load(bounds_ptr + piece + 1)
    offs_n = col0 + (pid_n % N_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col1
    if (pid_n % N_BLOCKS) * BLOCK_N >= col1 - col0:
        return
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    s = tl.load(s_ptr + tokens[:, None] * stride_sm + piece * R + offs_r[None, :],
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :].to(tl.int64) * stride_bn + piece * R
                + offs_r[:, None], mask=n_mask[None, :] & r_mask[:, None], other=0.0)
    delta = tl.dot(s, b.to(tl.float32), input_precision="tf32x3")
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_groups(token_lora: torch.Tensor, num_loras: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(order [T] int32, counts [L] int32, starts [L] int32)` on token_lora's device: the tokens
    sorted by slot (stable: token order within a slot; tokens without a slot last), each slot's
    token count and its first position in `order`. No host synchronisation (a scatter-add where
    torch.bincount would read the maximum back)."""
    slots = token_lora.to(torch.int64)
    key = torch.where((slots >= 0) & (slots < num_loras), slots, num_loras)
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(num_loras + 1, dtype=torch.int64, device=token_lora.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    return order, counts[:num_loras].to(torch.int32), starts[:num_loras].to(torch.int32)


def slice_bounds(output_slices: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """int32 `[S + 1]`: 0, then each output slice's end column."""
    ends, total = [0], 0
    for width in output_slices:
        total += width
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def check_inputs(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 token_lora: torch.Tensor, bounds: torch.Tensor) -> None:
    """Raise ValueError naming the argument whose shape, dtype or layout does not fit `add_lora`."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be [T, in] in one of {DTYPES} with unit column stride, got {tuple(x.shape)} "
                         f"{x.dtype}")
    t, k = x.shape
    if lora_a.dim() != 3 or lora_a.shape[2] != k or not lora_a.is_contiguous():
        raise ValueError(f"lora_a must be contiguous [L, S*R, in={k}], got {tuple(lora_a.shape)}")
    slots, sr = lora_a.shape[:2]
    if y.dim() != 2 or y.shape[0] != t or y.stride(1) != 1 or y.dtype != x.dtype:
        raise ValueError(f"y must be [T={t}, out] in x's dtype with unit column stride, got {tuple(y.shape)} "
                         f"{y.dtype}")
    if tuple(lora_b.shape) != (slots, y.shape[1], sr) or not lora_b.is_contiguous():
        raise ValueError(f"lora_b must be contiguous [L={slots}, out={y.shape[1]}, S*R={sr}], got "
                         f"{tuple(lora_b.shape)}")
    if lora_a.dtype != x.dtype or lora_b.dtype != x.dtype:
        raise ValueError(f"lora_a and lora_b must be in x's dtype {x.dtype}, got {lora_a.dtype} and {lora_b.dtype}")
    if token_lora.shape != (t,) or token_lora.dtype.is_floating_point:
        raise ValueError(f"token_lora must be integer [T={t}], got {tuple(token_lora.shape)} {token_lora.dtype}")
    pieces = bounds.shape[0] - 1
    if bounds.dim() != 1 or pieces < 1 or sr % pieces or bounds.dtype != torch.int32:
        raise ValueError(f"bounds must be int32 [S + 1] with S dividing S*R={sr}, got {tuple(bounds.shape)} "
                         f"{bounds.dtype}")


def add_lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_lora: torch.Tensor, output_slices: tuple[int, ...],
                    bounds: torch.Tensor | None = None) -> torch.Tensor:
    """Add each token's adapter update (module docstring) to `y` in place and return it;
    `output_slices`: the widths of y's column slices (their sum is y's width), `bounds` their
    `slice_bounds` on y's device (made here when None; pass it to avoid a copy per call)."""
    bounds = slice_bounds(output_slices, y.device) if bounds is None else bounds
    check_inputs(y, x, lora_a, lora_b, token_lora, bounds)
    (t, k), (slots, sr, _), out = x.shape, lora_a.shape, y.shape[1]
    if t == 0 or out == 0:
        return y
    pieces = bounds.shape[0] - 1
    if sum(output_slices) != out or len(output_slices) != pieces:
        raise ValueError(f"output_slices must be {pieces} widths summing to y's {out} columns, got {output_slices}")
    rank = sr // pieces
    order, counts, starts = lora_groups(token_lora, slots)
    shrunk = torch.empty((t, sr), dtype=torch.float32, device=x.device)
    launch = launch_for(t, sr, k, rank, x.dtype)
    m_blocks = triton.cdiv(t, launch.block_m)   # every token in one slot at most
    lora_shrink_kernel[(slots, m_blocks, triton.cdiv(sr, launch.block_n))](
        x, lora_a, shrunk, order, counts, starts, k, sr, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        shrunk.stride(0), BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        IEEE=x.dtype == torch.float32)
    n_blocks = triton.cdiv(max(output_slices), EXPAND_BLOCK_N)   # per slice: the widest slice's blocks
    lora_expand_kernel[(slots, m_blocks, pieces * n_blocks)](
        shrunk, lora_b, y, order, counts, starts, bounds, rank, n_blocks, shrunk.stride(0), lora_b.stride(0),
        lora_b.stride(1), y.stride(0), BLOCK_M=launch.block_m, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=launch.block_r)
    return y
