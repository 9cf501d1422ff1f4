"""Paged attention on torch SDPA/matmul: batched decode, per-request prefill.

Device-agnostic (plain torch), so it runs and is tested on CPU tensors;
backends use it as their fast path (and inside captured graphs).
Same contract as `reference_paged_attention`: write this step's k/v into
their slots, then attend each request's queries to its cached context;
returns `[T_pad, Hq, D]`.

- Decodes (the leading requests with one query token) are batched: each
  request's context is gathered from its block-table row and attended with
  an online softmax over chunks of blocks, so the gathered workspace stays
  below `DECODE_WORKSPACE_BYTES` however long the context is. GQA is folded
  into the query axis (`[B, Hkv, G, D]`), so K/V are never repeated.
- Prefills run one SDPA per request on 4-D `[1, heads, tokens, dim]` inputs
  (what the flash and memory-efficient kernels take; 3-D inputs always took
  the math kernel, which materialises the float32 score matrix): a fresh
  prompt attends to its own k/v with `is_causal`; a request with cached
  context attends to its gathered blocks with a lower-right causal bias
  (`torch.nn.attention.bias.causal_lower_right`, no mask tensor, so fused
  kernels stay eligible); a sliding window needs a boolean mask; a soft cap
  (`spec.logits_soft_cap`) takes the float32 formula (`capped_attention`).
- Static decode (`meta.extras[STATIC_DECODE]`, set by the graph executor for
  graph capture): every row is a decode over the full block-table width,
  with no host metadata, so the whole op can be captured in a graph. Rows with
  `seq_len == 0` (padding) attend to the null block's first slot, so their
  garbage stays finite.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import capped_attention, causal_mask, gather_context, soft_cap, write_kv
from polyrunner.numeric import cdiv

STATIC_DECODE = "static_decode"
DECODE_WORKSPACE_BYTES = 256 * 1024 * 1024


def num_leading_decodes(meta: AttentionMetadata) -> int:
    """Leading requests with exactly one query token, from the host query_start_loc."""
    q_lens = np.diff(meta.query_start_loc_np[: meta.num_reqs + 1])
    not_one = np.flatnonzero(q_lens != 1)
    return int(not_one[0]) if len(not_one) else meta.num_reqs


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, spec: LayerSpec, num_blocks: int,
                 workspace_bytes: int = DECODE_WORKSPACE_BYTES) -> torch.Tensor:
    """One query token per row: q `[B, Hq, D]` attends to the first `seq_lens[b]`
    cached tokens of its block-table row (`num_blocks` columns are read).
    Static shapes, no host synchronisation: safe inside a captured graph."""
    B, Hq, Dh = q.shape
    _, _, bs, Hkv, _ = kv_cache.shape
    G = Hq // Hkv
    elem = kv_cache.element_size()
    per_block = B * bs * (Hkv * Dh * (2 * elem + 8) + Hq * 4 * 3)  # k,v gathered + fp32 copies + scores
    chunk = max(1, min(num_blocks, workspace_bytes // max(per_block, 1)))
    qf = (q.float() * spec.scale).view(B, Hkv, G, Dh)
    lens = seq_lens.long().clamp(min=1)[:, None]                     # [B, 1]
    m = torch.full((B, Hkv, G, 1), float("-inf"), device=q.device)
    denom = torch.zeros((B, Hkv, G, 1), device=q.device)
    acc = torch.zeros((B, Hkv, G, Dh), device=q.device)
    for c0 in range(0, num_blocks, chunk):
        c1 = min(c0 + chunk, num_blocks)
        ids = block_tables[:, c0:c1].long()
        L = (c1 - c0) * bs
        kc = kv_cache[0][ids].reshape(B, L, Hkv, Dh).permute(0, 2, 3, 1).float()   # [B, Hkv, D, L]
        vc = kv_cache[1][ids].reshape(B, L, Hkv, Dh).permute(0, 2, 1, 3).float()   # [B, Hkv, L, D]
        pos = torch.arange(c0 * bs, c1 * bs, device=q.device)[None, :]
        valid = pos < lens
        if spec.sliding_window is not None:
            valid &= pos >= lens - spec.sliding_window
        # Slots past a request's length may hold anything (a backend may leave them
        # uninitialised): the scores are overwritten and the values zeroed, so NaN
        # garbage cannot leak through 0 * NaN.
        s = soft_cap(torch.matmul(qf, kc), spec.logits_soft_cap).masked_fill(~valid[:, None, None, :], float("-inf"))
        vc = vc.masked_fill(~valid[:, None, :, None], 0.0)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m - m_safe)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vc)
        m = m_new
    return (acc / denom).view(B, Hq, Dh).to(q.dtype)


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 block_ids: torch.Tensor, seq_len: int, spec: LayerSpec) -> torch.Tensor:
    """One request's `[n, Hq, D]` queries, the last n of its `seq_len` tokens."""
    n = q.shape[0]
    if seq_len == n and kv_cache.dtype == k.dtype:  # fresh prompt: its own k/v are the context
        ck, cv = k, v
    else:
        ck, cv = gather_context(kv_cache, block_ids, seq_len)
        ck, cv = ck.to(q.dtype), cv.to(q.dtype)
    if spec.logits_soft_cap is not None:  # SDPA cannot cap scores: the float32 formula
        mask = causal_mask(n, seq_len, spec.sliding_window, q.device)
        return capped_attention(q.transpose(0, 1), ck.transpose(0, 1), cv.transpose(0, 1), mask,
                                spec).transpose(0, 1)
    groups = spec.num_heads // spec.num_kv_heads
    if groups > 1:  # explicit GQA expansion (linear memory) keeps every fused SDPA kernel eligible
        ck, cv = ck.repeat_interleave(groups, dim=1), cv.repeat_interleave(groups, dim=1)
    mask, causal = None, False
    if spec.sliding_window is not None:
        mask = causal_mask(n, seq_len, spec.sliding_window, q.device)
    elif seq_len == n:
        causal = True  # no mask tensor: flash kernels apply
    else:
        from torch.nn.attention.bias import causal_lower_right  # here: importing it imports torch._dynamo (~2 s)
        mask = causal_lower_right(n, seq_len)  # query i at position seq_len - n + i, no tensor
    o = F.scaled_dot_product_attention(_bhsd(q), _bhsd(ck), _bhsd(cv), attn_mask=mask, is_causal=causal,
                                       scale=spec.scale)
    return o[0].transpose(0, 1)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """`[tokens, heads, dim]` -> `[1, heads, tokens, dim]` (a view; last dim stays contiguous)."""
    return x.transpose(0, 1).unsqueeze(0)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, spec: LayerSpec, decode=None) -> torch.Tensor:
    """Attention after this step's k/v are in the cache. `decode(q_dec, D)` may
    replace the batched decode (a device kernel); default `paged_decode`."""
    block_size = kv_cache.shape[2]
    if meta.extras.get(STATIC_DECODE):
        return paged_decode(q, kv_cache, meta.block_tables, meta.seq_lens, spec,
                            meta.block_tables.shape[1])
    out = torch.zeros_like(q)
    D = num_leading_decodes(meta)
    if D:
        if decode is not None:
            out[:D] = decode(q[:D], D)
        else:
            max_len = int(meta.seq_lens_np[:D].max())
            out[:D] = paged_decode(q[:D], kv_cache, meta.block_tables[:D], meta.seq_lens[:D], spec,
                                   cdiv(max_len, block_size))
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    for r in range(D, meta.num_reqs):
        start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        blocks = meta.block_tables[r, : cdiv(seq_len, block_size)].long()
        out[start:end] = _prefill_one(q[start:end], k[start:end], v[start:end], kv_cache,
                                      blocks, seq_len, spec)
    return out


def sdpa_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         kv_cache: torch.Tensor, meta: AttentionMetadata,
                         spec: LayerSpec) -> torch.Tensor:
    """Write k/v into their slots, then attend (see the module docstring)."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    return attend_cached(q, k, v, kv_cache, meta, spec)
