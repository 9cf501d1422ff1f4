"""Triton paged attention for mixed prefill + decode batches ("unified" attention).

One kernel serves any step: prefills, cached-context (chunked) prefills and
decodes in one launch. Everything it needs about the batch is read on the
device — `query_start_loc`, `seq_lens`, `block_tables` — so the launch depends
only on the padded shapes (`T_pad` tokens, `R_pad` requests) and is safe
inside a CUDA graph; its work follows each request's live length, not the
block-table width (which is what lets graphs be keyed by batch size alone).

Grid `(q_blocks, Hkv, segments)`. A program owns BLOCK_Q query tokens of one
request times the G = Hq/Hkv query heads sharing one KV head (GQA: K/V are
read once per group, never repeated): BLOCK_M >= BLOCK_Q * G rows of one
`tl.dot` (row m is query token m // G, head m % G; rows past BLOCK_Q * G or
past the request's last token are masked). Program p finds its request by
binary search over `query_start_loc // BLOCK_Q + index` (at most
`T_pad // BLOCK_Q + R_pad` q blocks exist; the surplus exits at once, as do
padded requests, whose query length is 0, and a request's q blocks never
cross into the next request). It walks the request's keys in tiles of TILE
tokens, looking up each key's block in the block table (any block size),
with a float32 online softmax: causal by absolute position (query i of a
request with context c sits at c + i), and the sliding window skips tiles
wholly before it. A logit soft cap (`LayerSpec.logits_soft_cap`, Gemma 2; the
SOFTCAP constexpr, 0.0 = none) turns each scaled score s into
SOFTCAP * tanh(s / SOFTCAP) before the mask, in every variant (decode, split
decode, prefill/mixed).

TILE, BLOCK_M, BLOCK_Q, num_warps and num_stages come from the launch table
(`attention_launch.launch_params`: by padded head size, dtype and whether the
step is decode-only), tuned so no entry spills registers on sm_90 with
unit head-dim strides; decode programs take max(16, G rounded up to a power
of two) rows, prefill/mixed programs 32-128.

Decode-only steps with few (request, KV head) pairs split each request's
keys into SEGMENTS parts (grid axis 2) written as partial (max, sum, acc) and
combined by a second kernel, so a batch of 1 still fills the GPU.

Dtypes: float16/bfloat16 inputs with float32 accumulation; float32 inputs use
IEEE float32 dots (no TF32), so they match a float32 reference tightly.
Padded token rows of the output are zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from polyrunner.backends.cuda.attention_launch import LaunchParams, launch_params
from polyrunner.backends.cuda.triton_kv_write import triton_write_kv
from polyrunner.plugin_api import AttentionMetadata, LayerSpec

SEGMENTS = 16                 # key segments per request in split decode
SPLIT_BELOW_PROGRAMS = 512    # split decode when R_pad * Hkv is below this
_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(qsl_ptr, target, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning global q block `target`: the last r with qsl[r] // BLOCK_Q + r <= target."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if val <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _softcap(s, cap: tl.constexpr):
    """cap * tanh(s / cap) without overflow: tanh|x| = (1 - e) / (1 + e) with e = 2^(-2|x| log2 e) in (0, 1]."""
    x = s / cap
    e = tl.exp2(tl.abs(x) * (-2.0 * 1.4426950408889634))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * cap


@triton.jit
def _attention_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    qsl_ptr, seq_lens_ptr, tables_ptr,
    scale_log2, num_reqs,
    q_st, q_sh, q_sd, o_st, o_sh, o_sd,
    kc_sb, kc_ss, kc_sh, kc_sd, vc_sb, vc_ss, vc_sh, vc_sd, tables_sr,
    NUM_HEADS: tl.constexpr, G: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    WINDOW: tl.constexpr, SEGMENTS: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    r = _find_request(qsl_ptr, qb, num_reqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    local = qb - (q_start // BLOCK_Q + r)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r)
    context = seq_len - q_len

    m_idx = tl.arange(0, BLOCK_M)
    d_idx = tl.arange(0, HEAD_PAD)
    q_idx = local * BLOCK_Q + m_idx // G                  # query index within the request
    head = kvh * G + m_idx % G
    row_ok = (m_idx // G < BLOCK_Q) & (q_idx < q_len)
    d_ok = d_idx < HEAD_SIZE
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * q_st + head[:, None] * q_sh + d_idx[None, :] * q_sd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + q_idx                                # absolute position of each row

    # keys [kv_start, kv_end) can be visible to some row of this q block
    kv_end = context + tl.minimum((local + 1) * BLOCK_Q, q_len)
    kv_start = 0
    if WINDOW > 0:
        kv_start = tl.maximum(context + local * BLOCK_Q - WINDOW + 1, 0)
    tile_lo = kv_start // TILE
    tile_hi = tl.cdiv(kv_end, TILE)
    if SEGMENTS > 1:
        per_seg = tl.cdiv(tile_hi - tile_lo, SEGMENTS)
        tile_lo = tile_lo + seg * per_seg
        tile_hi = tl.minimum(tile_lo + per_seg, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table_row = tables_ptr + r.to(tl.int64) * tables_sr
    for t in range(tile_lo, tile_hi):
        k_pos = t * TILE + tl.arange(0, TILE)
        k_ok = k_pos < kv_end
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        in_block = (k_pos % BLOCK_SIZE).to(tl.int64)
        k = tl.load(kc_ptr + block[None, :] * kc_sb + in_block[None, :] * kc_ss + kvh * kc_sh
                    + d_idx[:, None] * kc_sd, mask=d_ok[:, None] & k_ok[None, :], other=0.0)
        v = tl.load(vc_ptr + block[:, None] * vc_sb + in_block[:, None] * vc_ss + kvh * vc_sh
                    + d_idx[None, :] * vc_sd, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        if SOFTCAP > 0:   # cap the natural-log-scale score, then back to log2 units
            s = _softcap(s * (scale_log2 * 0.6931471805599453), SOFTCAP) * 1.4426950408889634
        else:
            s = s * scale_log2
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * o_st + head[:, None] * o_sh + d_idx[None, :] * o_sd,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partials: [T_pad, Hq, SEGMENTS, HEAD_PAD] and [T_pad, Hq, SEGMENTS, 2]
        row = (token * NUM_HEADS + head) * SEGMENTS + seg
        tl.store(part_acc_ptr + row[:, None] * HEAD_PAD + d_idx[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr, num_reqs, o_st, o_sh, o_sd,
                    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
                    SEGMENTS: tl.constexpr):
    """Merge the segments of one (token, head): rescale each partial to the global max."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(qsl_ptr + num_reqs):  # a padded token: no partials were written
        return
    s_idx = tl.arange(0, SEGMENTS)
    d_idx = tl.arange(0, HEAD_PAD)
    row = (token * NUM_HEADS + head) * SEGMENTS + s_idx
    m = tl.load(part_ml_ptr + row * 2)
    l_seg = tl.load(part_ml_ptr + row * 2 + 1)
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_PAD + d_idx[None, :])
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_seg * w, axis=0)
    tl.store(out_ptr + token * o_st + head * o_sh + d_idx * o_sd, out.to(out_ptr.dtype.element_ty),
             mask=d_idx < HEAD_SIZE)


def unified_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      spec: LayerSpec, *, decode_only: bool = False,
                      segments: int | None = None, launch: LaunchParams | None = None) -> torch.Tensor:
    """Attention of q `[T_pad, Hq, D]` over the paged caches `[NB, bs, Hkv, D]`
    (any strides). `query_start_loc` `[R_pad + 1]`, `seq_lens` `[R_pad]`,
    `block_tables` `[R_pad, W]` (int32) live on q's device; the step's tokens must
    already be in the caches. `decode_only` (every request has one query token)
    allows split decode and picks the decode row of the launch table; `segments`
    forces the segment count (1 = no split), `launch` the launch parameters
    (default `launch_params(D, q.dtype, Hq // Hkv, decode_only)`).
    Returns `[T_pad, Hq, D]` in q's dtype, zero on padded rows."""
    T, num_heads, head = q.shape
    block_size, num_kv = key_cache.shape[1], key_cache.shape[2]
    if num_heads != spec.num_heads or num_kv != spec.num_kv_heads or head != spec.head_size:
        raise ValueError(f"q {tuple(q.shape)} / cache {tuple(key_cache.shape)} do not match {spec}")
    if num_heads % num_kv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv})")
    R = seq_lens.shape[0]
    out = torch.zeros_like(q)
    if T == 0 or R == 0:
        return out
    group = num_heads // num_kv
    if launch is None:
        launch = launch_params(head, q.dtype, group, decode_only)
    if not launch.fits(group):
        raise ValueError(f"{launch} does not fit group {group}: needs 1 <= BLOCK_Q, BLOCK_Q * G <= BLOCK_M "
                         "and TILE, BLOCK_M powers of two >= 16")
    if segments is None:
        segments = SEGMENTS if decode_only and R * num_kv < SPLIT_BELOW_PROGRAMS else 1
    head_pad = max(16, triton.next_power_of_2(head))
    window = spec.sliding_window or 0
    if spec.logits_soft_cap is not None and not spec.logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0 (or None), got {spec.logits_soft_cap}")
    softcap = float(spec.logits_soft_cap or 0.0)
    if segments > 1:
        part_acc = torch.empty((T, num_heads, segments, head_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((T, num_heads, segments, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    grid = (T // launch.block_q + R, num_kv, segments)
    _attention_kernel[grid](
        q, key_cache, value_cache, out, part_acc, part_ml,
        query_start_loc, seq_lens, block_tables,
        spec.scale * _LOG2E, R,
        *q.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), block_tables.stride(0),
        NUM_HEADS=num_heads, G=group, HEAD_SIZE=head, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, TILE=launch.tile, BLOCK_M=launch.block_m, BLOCK_Q=launch.block_q,
        WINDOW=window, SEGMENTS=segments, IEEE=q.dtype == torch.float32, SOFTCAP=softcap,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    if segments > 1:
        _combine_kernel[(T, num_heads)](
            out, part_acc, part_ml, query_start_loc, R, *out.stride(),
            NUM_HEADS=num_heads, HEAD_SIZE=head, HEAD_PAD=head_pad, SEGMENTS=segments)
    return out


def triton_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                           meta: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
    """The backend attention op: write k/v at `meta.slot_mapping`, then `unified_attention`.
    Same contract as `reference_paged_attention`; graph-safe (no host reads)."""
    triton_write_kv(kv_cache, k, v, meta.slot_mapping)
    return unified_attention(q, kv_cache[0], kv_cache[1], meta.query_start_loc, meta.seq_lens,
                             meta.block_tables, spec, decode_only=meta.max_query_len == 1)
