"""Static-shape paged attention in plain torch: one graph per padded token count.

For graph compilers (XLA, and any backend that must not see data-dependent
shapes or host loops). Every shape depends only on `T_pad` and the block-table
width; no host metadata, no Python loop over requests, no slicing by a tensor
value. Each token gathers its own request's context through a per-token block
table and masks it causally by position, so padded tokens and padded requests
cost work but never disturb real rows.

Per-token block table: `meta.extras["token_block_tables"]` `[T_pad, max_blocks]`
int32 when the backend built it on the host (so the graph does not depend on
the request padding); otherwise `meta.block_tables[meta.token_to_req]`.

Memory: the gathered context is `T_pad x max_blocks*block_size x Hkv x D`
per layer (keys and values), so this suits small models and short contexts;
large deployments use a device kernel (e.g. Pallas ragged paged attention).
"""

from __future__ import annotations

import torch

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import soft_cap, write_kv

TOKEN_BLOCK_TABLES = "token_block_tables"


def token_block_tables(meta: AttentionMetadata) -> torch.Tensor:
    """`[T_pad, max_blocks]`: the block table row of each token's request."""
    tables = meta.extras.get(TOKEN_BLOCK_TABLES)
    if tables is None:
        tables = meta.block_tables[meta.token_to_req.long()]
    return tables


def static_shape_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 kv_cache: torch.Tensor, meta: AttentionMetadata,
                                 spec: LayerSpec) -> torch.Tensor:
    """Write k/v, then attend each token to its request's context up to its position.

    q: `[T_pad, Hq, D]`, k/v: `[T_pad, Hkv, D]`, kv_cache: `[2, NB, bs, Hkv, D]`
    (logical layout). Returns `[T_pad, Hq, D]`; padded rows hold finite garbage. A soft cap
    (`spec.logits_soft_cap`) applies to the scaled scores before the causal/window mask.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    T, num_heads, head = q.shape
    block_size, num_kv = kv_cache.shape[2], kv_cache.shape[3]
    tables = token_block_tables(meta).long()                      # [T, B]
    ctx = tables.shape[1] * block_size
    keys = kv_cache[0][tables].reshape(T, ctx, num_kv, head)       # [T, L, Hkv, D]
    values = kv_cache[1][tables].reshape(T, ctx, num_kv, head)
    group = num_heads // num_kv
    qg = q.reshape(T, num_kv, group, head).float()
    scores = soft_cap(torch.einsum("thgd,tlhd->thgl", qg, keys.float()) * spec.scale, spec.logits_soft_cap)
    k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)        # [1, L]
    q_pos = meta.positions.unsqueeze(1)                            # [T, 1]
    visible = k_pos <= q_pos
    if spec.sliding_window is not None:
        visible = visible & (k_pos > q_pos - spec.sliding_window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("thgl,tlhd->thgd", probs, values.float())
    return out.reshape(T, num_heads, head).to(q.dtype)
