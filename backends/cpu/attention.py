"""CPU paged attention: C++ kernels for decodes and bfloat16 prefills, else SDPA per prefill.

One kernel call per layer writes the step's keys/values into their slots and
attends every decode request (the leading `num_decodes` rows) straight from
the cache blocks: no per-layer gather of the context. Prefill requests (rows
after the decodes, many queries each) in bfloat16 on a CPU with AVX512_BF16
go through `prefill_attention.cpp` (packed keys/values, `vdpbf16ps` tiles:
prefill steps of W1 ~30% faster than torch's flash attention gave); otherwise through
`scaled_dot_product_attention`: a fresh prompt attends its own k/v with
`is_causal`; a chunk with earlier context gathers that request's blocks once.
SDPA has no logit soft cap: a soft-capped layer's (Gemma 2) prefills that the bfloat16
kernel does not take run the C++ kernel's general loops (`attend`) instead.

Under `torch.compile` (the backend itself runs eagerly; this is for callers
that compile the model) the kernel is the custom op
`polyrunner_cpu::paged_attention` over all (padded) requests, one opaque call.
Without the kernel (no C++ compiler, float16) this is the reference attention.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from polyrunner.backends.cpu import envs, kernel_table, kernels
from polyrunner.plugin_api import AttentionMetadata, LayerSpec, causal_mask, cdiv, reference_paged_attention

logger = logging.getLogger(__name__)
_warned = False


def cpu_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: torch.Tensor, meta: AttentionMetadata,
                        spec: LayerSpec) -> torch.Tensor:
    """Same contract as `reference_paged_attention`; padded rows are zero."""
    window = spec.sliding_window or 0
    softcap = spec.logits_soft_cap or 0.0
    if torch.compiler.is_compiling():
        out = torch.zeros_like(q)
        kernels.paged_attention_op(q, k, v, kv_cache, meta.slot_mapping, meta.query_start_loc,
                                   meta.seq_lens, meta.block_tables, out, spec.scale, window, softcap)
        return out
    if not kernels.kernel_supports(q, kv_cache):
        global _warned
        if not _warned:
            _warned = True
            logger.warning("CPU attention kernel not used (dtype %s or kernel unavailable): "
                           "falling back to the reference attention", q.dtype)
        return reference_paged_attention(q, k, v, kv_cache, meta, spec)
    T = meta.num_actual_tokens
    out = torch.empty_like(q)
    if out.shape[0] > T:
        out[T:].zero_()
    nd, R = meta.num_decodes, meta.num_reqs
    kernels.call_kernel(q, k, v, kv_cache, meta.slot_mapping, meta.num_padded_tokens,
                        meta.query_start_loc, meta.seq_lens, meta.block_tables, out,
                        0, nd, spec.scale, window, softcap)
    if R > nd and not kernels.prefill_attention_bf16(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                                      meta.block_tables, out, nd, R, spec.scale, window,
                                                      prefill_uses_amx(q, kv_cache), softcap):
        if softcap:   # SDPA cannot cap the scores: the kernel's general loops (k/v already written)
            kernels.call_kernel(q, k, v, kv_cache, meta.slot_mapping, 0, meta.query_start_loc, meta.seq_lens,
                                meta.block_tables, out, nd, R, spec.scale, window, softcap)
        else:
            _prefill(q, k, v, kv_cache, meta, spec, out, nd, R)
    return out


_choice: dict[tuple, bool] = {}


def prefill_uses_amx(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether bfloat16 prefills of this head shape run the AMX variant of the prefill kernel:
    `POLYRUNNER_CPU_PREFILL_ATTENTION`, else the faster of the two on a 256-token prompt, timed once
    per machine (`kernel_table.cached`) and remembered per process."""
    Hq, (_, _, bs, Hkv, D) = q.shape[1], kv_cache.shape
    if q.dtype != torch.bfloat16 or D not in (64, 128) or not kernels.simd_bf16():
        return False   # no prefill kernel for this at all (SDPA runs)
    forced = envs.PREFILL_ATTENTION.get()
    key = (Hq, Hkv, D, bs, torch.get_num_threads(), forced, id(kernels.paged_attention_kernel()))
    if key not in _choice:
        why = kernels.prefill_attention_amx_reason()
        if forced == "amx" and why is not None:
            raise ValueError(f"POLYRUNNER_CPU_PREFILL_ATTENTION=amx: the AMX kernel cannot run here ({why})")
        if forced != "auto" or why is not None:
            _choice[key] = forced == "amx"
        else:
            times = kernel_table.cached(f"prefill attention {Hq}/{Hkv}x{D} block {bs}",
                                        lambda: _time_prefill(Hq, Hkv, D, bs), threads=key[4])
            _choice[key] = sum(times["amx"].values()) < sum(times["dpbf16"].values())
    return _choice[key]


def _time_prefill(Hq: int, Hkv: int, D: int, bs: int, L: int = 256) -> kernel_table.Times:
    """us per call of each prefill kernel on one fresh prompt of L tokens (the kernels take turns)."""
    g = torch.Generator().manual_seed(0)
    nb = cdiv(L, bs)
    q = torch.randn(L, Hq, D, generator=g).to(torch.bfloat16)
    cache = torch.randn(2, nb + 1, bs, Hkv, D, generator=g).to(torch.bfloat16)
    qsl, seq_lens = torch.tensor([0, L], dtype=torch.int32), torch.tensor([L], dtype=torch.int32)
    table = torch.arange(1, nb + 1, dtype=torch.int32)[None]
    out = torch.empty_like(q)
    best = kernel_table.time_in_turns(
        {name: (lambda amx=name == "amx": kernels.prefill_attention_bf16(q, cache, qsl, seq_lens, table, out, 0, 1,
                                                                        D ** -0.5, 0, amx))
         for name in ("amx", "dpbf16")})
    return {name: {L: t} for name, t in best.items()}


def _prefill(q, k, v, kv_cache, meta, spec, out, first: int, last: int) -> None:
    """SDPA for requests [first, last), each with its own causal (bottom-right) mask."""
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    block_size = kv_cache.shape[2]
    gqa = spec.num_heads != spec.num_kv_heads
    window = spec.sliding_window
    for r in range(first, last):
        start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        nq = end - start
        if nq <= 0:
            continue
        if seq_len == nq:  # the whole context is this step's tokens
            ck, cv = k[start:end], v[start:end]
        else:
            nb = cdiv(seq_len, block_size)
            blocks = meta.block_tables[r, :nb].long()
            ck = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
            cv = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
        mask, causal = None, False
        if seq_len == nq and (window is None or window >= seq_len):
            causal = True
        else:
            mask = causal_mask(nq, seq_len, window, q.device)
        # 4-D inputs: the CPU flash kernel takes [batch, heads, seq, dim] only (3-D runs the math path)
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], ck.transpose(0, 1)[None], cv.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=spec.scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
