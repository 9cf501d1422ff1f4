"""Token-to-expert grouping for the fused-MoE kernel (`triton_moe.py`), as vLLM's
`moe_align_block_size`: the `T * k` (token, expert) pairs of `topk_ids [T, k]`, numbered
`pair = t * k + j`, sorted by expert (stable: token order within an expert), each expert's group
padded to a multiple of `block_size` with the sentinel `T * k`.

Computed with vectorised torch ops on `topk_ids`' device, with no host synchronisation (the
output sizes depend only on `T * k`, `num_experts` and `block_size`, so a CUDA graph can hold
it). Does not import triton.
"""

from __future__ import annotations

import torch


def max_num_tokens_padded(num_pairs: int, num_experts: int, block_size: int) -> int:
    """The length of `sorted_token_ids`: every pair plus at most `block_size - 1` padding per
    expert that receives a pair (at most `min(num_experts, num_pairs)` of them)."""
    return num_pairs + min(num_experts, num_pairs) * (block_size - 1)


def max_num_m_blocks(num_pairs: int, num_experts: int, block_size: int) -> int:
    """The length of `expert_ids`: a bound on the blocks the padded groups fill (each expert
    with `n > 0` pairs fills `ceil(n / block_size) <= n` blocks)."""
    return min(-(-max_num_tokens_padded(num_pairs, num_experts, block_size) // block_size), num_pairs)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(sorted_token_ids, expert_ids, num_tokens_post_padded)`, all int32 on `topk_ids`' device:

    - `sorted_token_ids [max_num_tokens_padded]`: pair ids grouped by expert, each group starting
      at a multiple of `block_size` and padded with the sentinel `topk_ids.numel()`; the tail past
      `num_tokens_post_padded` is sentinels too;
    - `expert_ids [max_num_m_blocks]`: the expert of each block of `block_size` entries; -1 for
      blocks past `num_tokens_post_padded`;
    - `num_tokens_post_padded [1]`: the padded groups' total length (a multiple of `block_size`).

    `topk_ids` holds expert ids in `[0, num_experts)` (any integer dtype, any shape)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    sorted_ids = torch.full((max_num_tokens_padded(num_pairs, num_experts, block_size),), num_pairs,
                            dtype=torch.int32, device=device)
    num_blocks = max_num_m_blocks(num_pairs, num_experts, block_size)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))          # pairs per expert (bincount would sync)
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)                     # pair ids by expert, token order kept
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    sorted_ids[(padded_end - padded)[expert_of] + rank] = order.to(torch.int32)
    total = padded_end[-1:]
    block_start = torch.arange(num_blocks, device=device) * block_size
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_start < total, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)
