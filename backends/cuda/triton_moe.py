"""The fused mixture-of-experts experts computation in Triton, after vLLM's `fused_moe`:

    fused_experts(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k]) -> [T, H]
    out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),  e = topk_ids[t, j]

The (token, expert) pairs are grouped by expert and padded to the kernel's BLOCK_SIZE_M
(`moe_align.moe_align_block_size`); `fused_moe_kernel` then runs one program per (M block,
N block) of the sorted pairs: it gathers the block's token rows, multiplies them by its one
expert's weight tile (float32 accumulation) and writes the rows at their pair index. Two
launches: gate_up (`w13`, into `[T * k, 2I]`), SiLU-and-mul (`triton_activation`), then down
(`w2`, scaled by the routing weight, into `[T * k, H]`), and a sum over the k pairs of each token.
float16, bfloat16 and float32 (IEEE dots); no host synchronisation. Importing this module
imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrunner.backends.cuda.moe_align import moe_align_block_size
from polyrunner.backends.cuda.moe_launch import MoELaunch, launch_for
from polyrunner.backends.cuda.triton_activation import silu_and_mul

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def fused_moe_kernel(a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                     num_tokens_post_padded_ptr, N, K, EM, num_valid_tokens,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                     BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                     GROUP_SIZE_M: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, top_k: tl.constexpr,
                     IEEE: tl.constexpr):
    """C[pair, :N] = (weight[pair] *) A[pair // top_k, :K] @ B[expert, :N, :K].T for the pairs of one
    M block of `sorted_token_ids` (sentinels >= num_valid_tokens skipped) and one N block."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
        return
    offs_token_id = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    offs_token = tl.load(sorted_token_ids_ptr + offs_token_id).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    off_expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_token[:, None] // top_k) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + off_expert * stride_be + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        k_left = K - kb * BLOCK_SIZE_K
        a = tl.load(a_ptrs, mask=token_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IEEE:
            accumulator = tl.dot(a, b, accumulator, input_precision="ieee")
        else:
            accumulator += tl.dot(a, b)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    if MUL_ROUTED_WEIGHT:
        moe_weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0)
        accumulator = accumulator * moe_weight[:, None]

    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, accumulator.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & (offs_cn[None, :] < N))


def invoke_fused_moe_kernel(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
                            sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                            num_tokens_post_padded: torch.Tensor, mul_routed_weight: bool, top_k: int,
                            launch: MoELaunch) -> None:
    """One launch of `fused_moe_kernel`: `c [P, N]` rows at the pairs' positions (P = pairs) from
    `a [P / top_k, K]` and `b [E, N, K]`; `topk_weights` (float32, contiguous, P elements) scales
    the rows when `mul_routed_weight`. The align tensors are `moe_align_block_size`'s at
    `launch.block_size_m`."""
    n, k = b.shape[1], b.shape[2]
    em = expert_ids.shape[0] * launch.block_size_m
    if em == 0 or n == 0:
        return
    grid = (triton.cdiv(em, launch.block_size_m) * triton.cdiv(n, launch.block_size_n),)
    fused_moe_kernel[grid](
        a, b, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, n, k, em, c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        BLOCK_SIZE_M=launch.block_size_m, BLOCK_SIZE_N=launch.block_size_n, BLOCK_SIZE_K=launch.block_size_k,
        GROUP_SIZE_M=launch.group_size_m, MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k,
        IEEE=a.dtype == torch.float32, num_warps=launch.num_warps, num_stages=launch.num_stages)


def check_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> None:
    """Raise ValueError naming the argument whose shape or dtype does not fit `fused_experts`."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [T, H] in one of {DTYPES}, got {tuple(x.shape)} {x.dtype}")
    t, h = x.shape
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2I, H={h}], got {tuple(w13.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"w2 must be [E={e}, H={h}, I={inter}], got {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"w13 and w2 must be in x's dtype {x.dtype}, got {w13.dtype} and {w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be integer [T={t}, k], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32 {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum (module docstring) as a new `[T, H]` tensor in x's dtype. The
    expert ids must lie in `[0, E)` (not checked: that would synchronise with the device)."""
    check_inputs(x, w13, w2, topk_weights, topk_ids)
    (t, h), (e, n13, _), top_k = x.shape, w13.shape, topk_ids.shape[1]
    pairs = t * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    launch = launch_for(t, top_k, e, x.dtype)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, launch.block_size_m, e)
    weights = topk_weights.contiguous()
    gate_up = torch.empty((pairs, n13), dtype=x.dtype, device=x.device)
    invoke_fused_moe_kernel(x, w13, gate_up, weights, sorted_ids, expert_ids, num_post, False, top_k, launch)
    act = silu_and_mul(gate_up)
    down = torch.empty((pairs, h), dtype=x.dtype, device=x.device)
    invoke_fused_moe_kernel(act, w2, down, weights, sorted_ids, expert_ids, num_post, True, 1, launch)
    return down.view(t, top_k, h).sum(dim=1)
