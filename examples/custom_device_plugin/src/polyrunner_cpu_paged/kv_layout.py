"""Heads-major paged KV cache: physical `[2, kv_heads, num_blocks, block_size, head_size]`.

polyrunner's core indexes every KV cache through ONE logical shape,
`[2, num_blocks, block_size, kv_heads, head_size]` (see
`polyrunner.plugin_api.KVCacheSpec`). A backend may store it in any physical
order as long as the tensor it hands back is a *view* with that logical
shape. Here the heads come outermost, so one request's context of one head
is a contiguous run of `num_blocks * block_size * head_size` values: the
attention below reads `[heads, context, head_size]` directly, which is the
layout `scaled_dot_product_attention` wants, with no transpose.

Each layer lives in one buffer whose first byte is aligned to
`ALIGNMENT` (a cache line), the contract declared as
`Backend.kv_alignment_bytes` and certified by the conformance suite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyrunner.plugin_api import NULL_BLOCK, AttentionMetadata, KVCacheSpec, LayerSpec, cdiv

ALIGNMENT = 64


def physical_shape(spec: KVCacheSpec, num_blocks: int) -> tuple[int, int, int, int, int]:
    return (2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_size)


def aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, alignment: int = ALIGNMENT) -> torch.Tensor:
    """An uninitialised contiguous tensor whose data starts on an `alignment`-byte boundary."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = elem * torch.Size(shape).numel()
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset: offset + nbytes].view(dtype).view(shape)


def allocate(spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
    """One heads-major buffer per layer, returned as its logical view.
    Only the null block is zeroed: padded requests may read it, every other
    slot is written before it is read."""
    caches = []
    for _ in range(spec.num_layers):
        phys = aligned_empty(physical_shape(spec, num_blocks), spec.dtype)
        phys[:, :, NULL_BLOCK].zero_()
        caches.append(phys.permute(0, 2, 3, 1, 4))  # logical [2, nb, bs, H, D]
    return caches


def physical(kv_cache: torch.Tensor) -> torch.Tensor:
    """The heads-major tensor behind a logical view (a view, no copy)."""
    return kv_cache.permute(0, 3, 1, 2, 4)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
    """Write this step's K/V at `slot_mapping`, then attend.

    q `[T_pad, Hq, D]`, k/v `[T_pad, Hkv, D]`; returns `[T_pad, Hq, D]`, padded rows zero.
    Decodes (the first `meta.num_decodes` requests, one token each) run as ONE
    batched SDPA over their gathered contexts; prefills run per request.
    Padded tokens carry slot 0 (`NULL_SLOT`) and write only the null block.
    """
    phys = physical(kv_cache)                                   # [2, H, nb, bs, D]
    bs = phys.shape[3]
    slots = meta.slot_mapping
    blocks, offsets = slots // bs, slots % bs
    phys[0][:, blocks, offsets] = k.transpose(0, 1).to(phys.dtype)
    phys[1][:, blocks, offsets] = v.transpose(0, 1).to(phys.dtype)
    out = torch.zeros_like(q)
    gqa = spec.num_heads != spec.num_kv_heads
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    d = int(meta.num_decodes)
    if d:
        lens = torch.from_numpy(seq_lens[:d].astype("int64"))
        nb = cdiv(int(lens.max()), bs)
        table = meta.block_tables[:d, :nb].long()                # [d, nb]
        keys = phys[0][:, table].flatten(2, 3).transpose(0, 1)  # [d, H, nb*bs, D]
        values = phys[1][:, table].flatten(2, 3).transpose(0, 1)
        k_pos = torch.arange(nb * bs)
        visible = k_pos[None, :] < lens[:, None]                 # [d, L]
        if spec.sliding_window is not None:
            visible &= k_pos[None, :] > (lens[:, None] - 1 - spec.sliding_window)
        # Slots past a request's length were never written (uninitialised memory,
        # possibly NaN): zero them, a -inf score alone would still give 0 * NaN.
        keep = visible[:, None, :, None]
        keys = torch.where(keep, keys, 0)
        values = torch.where(keep, values, 0)
        o = F.scaled_dot_product_attention(q[:d].unsqueeze(2), keys.to(q.dtype), values.to(q.dtype),
                                           attn_mask=visible[:, None, None, :], scale=spec.scale,
                                           enable_gqa=gqa)
        out[:d] = o.squeeze(2)
    for r in range(d, meta.num_reqs):
        start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        ids = meta.block_tables[r, : cdiv(seq_len, bs)].long()
        keys = phys[0][:, ids].flatten(1, 2)[:, :seq_len]       # [H, L, D], contiguous per head
        values = phys[1][:, ids].flatten(1, 2)[:, :seq_len]
        n = end - start
        q_pos = torch.arange(seq_len - n, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = k_pos <= q_pos
        if spec.sliding_window is not None:
            mask &= k_pos > q_pos - spec.sliding_window
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), keys.to(q.dtype), values.to(q.dtype),
                                           attn_mask=mask, scale=spec.scale, enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)
    return out
