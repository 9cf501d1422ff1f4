"""Reference paged attention in plain torch: correct on any device, not fast.

KV cache layout (logical, per layer): `[2, num_blocks, block_size, num_kv_heads,
head_size]`; index 0 holds keys, 1 values. A backend may store it with other
strides; indexing below only uses the logical shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.numeric import cdiv


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values `[T_pad, Hkv, D]` into their slots."""
    block_size = kv_cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[0, blocks, offsets] = k.to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = v.to(kv_cache.dtype)


def causal_mask(num_queries: int, seq_len: int, sliding_window: int | None,
                device: torch.device) -> torch.Tensor:
    """Bool `[num_queries, seq_len]`: query i sits at position seq_len - num_queries + i."""
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`cap * tanh(scores / cap)` (attention logit soft-capping); `scores` unchanged when cap is None."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     spec: LayerSpec) -> torch.Tensor:
    """Soft-capped attention in float32: q `[Hq, n, D]`, k/v `[Hkv, L, D]`, bool mask `[n, L]`
    -> `[Hq, n, D]` in q's dtype. Scores are scaled, capped, then masked (what SDPA cannot do)."""
    groups = spec.num_heads // spec.num_kv_heads
    kf = k.float().repeat_interleave(groups, dim=0)
    vf = v.float().repeat_interleave(groups, dim=0)
    scores = soft_cap(torch.matmul(q.float(), kf.transpose(1, 2)) * spec.scale, spec.logits_soft_cap)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, vf).to(q.dtype)


def gather_context(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                   seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[seq_len, Hkv, D]` of one request, from its block ids."""
    k = kv_cache[0, block_ids].flatten(0, 1)[:seq_len]
    v = kv_cache[1, block_ids].flatten(0, 1)[:seq_len]
    return k, v


def reference_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              kv_cache: torch.Tensor, meta: AttentionMetadata,
                              spec: LayerSpec) -> torch.Tensor:
    """Write k/v, then attend each request's queries to its cached context.

    q: `[T_pad, Hq, D]`, k/v: `[T_pad, Hkv, D]`; returns `[T_pad, Hq, D]` with
    padded rows zero. Loops over requests (host metadata), never over tokens.
    `spec.sliding_window` limits each query to its last window keys; `spec.logits_soft_cap`
    caps the scaled scores (`soft_cap`) before the mask and softmax.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.zeros_like(q)
    block_size = kv_cache.shape[2]
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    for r in range(meta.num_reqs):
        start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        num_blocks = cdiv(seq_len, block_size)
        ck, cv = gather_context(kv_cache, meta.block_tables[r, :num_blocks].long(), seq_len)
        mask = causal_mask(end - start, seq_len, spec.sliding_window, q.device)
        if spec.logits_soft_cap is not None:
            out[start:end] = capped_attention(q[start:end].transpose(0, 1), ck.transpose(0, 1),
                                              cv.transpose(0, 1), mask, spec).transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), ck.transpose(0, 1).to(q.dtype),
            cv.transpose(0, 1).to(q.dtype), attn_mask=mask, scale=spec.scale,
            enable_gqa=spec.num_heads != spec.num_kv_heads)
        out[start:end] = o.transpose(0, 1)
    return out
