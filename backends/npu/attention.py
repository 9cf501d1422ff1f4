"""Ascend attention through torch_npu, as vllm-ascend runs it (vllm_ascend/attention/attention_v1.py).

- KV write: `_npu_reshape_and_cache` at int32 slots.
- A decode-only step: `_npu_paged_attention` over the batch (writes `out=`), context lengths on the
  host, the block table cut to the longest context's blocks. A sliding-window layer:
  `npu_fused_infer_attention_score.out` with one query token per request (layout BSND, S = 1); the
  op ignores sparse modes and pre_tokens for a single query token, so the window is a
  `[B, 1, 1, KV_S]` mask built on the device from `seq_lens` (a graph recomputes it each replay).
- A step with prefill tokens: ONE `npu_fused_infer_attention_score` call for the whole ragged batch
  (decodes included): TND layout over the paged cache, host cumulative query ends and KV lengths,
  sparse_mode 3 (right-down causal) with the 2048 x 2048 mask. TND takes sparse modes 0 and 3 only,
  so a sliding-window layer packs the batch's queries into BSND (`[R, S, heads, D]`, one gather
  and one scatter by host-built indices) and runs sparse_mode 4 (band: pre_tokens = window - 1).
- Decode graphs (`STATIC_DECODE`): each decode op is captured in a task group with its workspace,
  behind an ExternalEvent, and updated before each replay (graph.py). Reads the context's blocks only.
- The per-step tensors every layer needs (int32 slots, host lengths, the block table's used
  columns) are built once per step (`step_tensors`, cached in `meta.extras`).

The core's SDPA attention runs instead without torch_npu, on tensors off the NPU, for a soft-
capped layer (the backend declares no soft cap, so the engine refuses such models) or when the
KV cache's dtype differs from the queries'.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from polyrunner.backends.npu import graph
from polyrunner.backends.npu.device import device_type, npu_module
from polyrunner.plugin_api import STATIC_DECODE, AttentionMetadata, LayerSpec, sdpa_paged_attention

NPU_STEP = "npu_step"        # meta.extras key of the step's `StepTensors`
NPU_PACKING = "npu_bsnd"     # meta.extras key of the step's `Packing`
MASK_SIZE = 2048             # npu_fused_infer_attention_score's compressed mask for sparse_mode 2/3/4


@dataclass(frozen=True)
class StepTensors:
    """What every layer of one step hands the torch_npu ops."""

    slots: torch.Tensor            # int32 [T_pad], device
    block_table: torch.Tensor      # int32 [R, W], device (W: the longest context's blocks; static width in graphs)
    context_lens: torch.Tensor     # int32 [R], host
    query_ends: list[int]          # cumulative query lengths (TND actual_seq_lengths)
    kv_lens: list[int]             # context lengths (actual_seq_lengths_kv)
    decode_only: bool
    captured: bool                 # built while a graph was captured (a warm-up's tensors are not reused)


@dataclass(frozen=True)
class Packing:
    """A ragged batch as BSND rows: token t is row `scatter[t]` of `[R * S]`; row r is token `gather[r]`
    (rows past a request's queries repeat token 0, which the op reads past its lengths only)."""

    gather: torch.Tensor     # int64 [R * S], device
    scatter: torch.Tensor    # int64 [T], device
    query_lens: list[int]
    S: int


@functools.lru_cache(maxsize=None)
def causal_mask(device: torch.device) -> torch.Tensor:
    """The bool upper-triangular [2048, 2048] mask (True = masked) sparse modes 3 and 4 take."""
    return torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu_(1)


def step_tensors(meta: AttentionMetadata, block_size: int) -> StepTensors:
    """This step's `StepTensors`, built by the first layer and reused by the others."""
    capturing = bool(npu_module().is_current_stream_capturing())
    cached: StepTensors | None = meta.extras.get(NPU_STEP)
    if cached is not None and cached.captured == capturing:
        return cached
    R = meta.num_reqs
    if meta.extras.get(STATIC_DECODE):   # a decode graph: the static table, the capture's host lengths
        lens = graph.capture_context_lens()
        if lens is None:
            raise RuntimeError("npu: a static decode step outside an ACL graph capture")
        table, kv_lens, query_ends = meta.block_tables, lens.tolist(), list(range(1, meta.num_reqs + 1))
    else:
        seq_lens = meta.seq_lens_np[:R]
        width = -(-int(seq_lens.max(initial=1)) // block_size)
        table = meta.block_tables[:R, :width].contiguous()
        lens = graph.host_context_lens(seq_lens, R)
        kv_lens = seq_lens.tolist()
        query_ends = meta.query_start_loc_np[1:R + 1].tolist()
    step = StepTensors(slots=meta.slot_mapping.to(torch.int32), block_table=table, context_lens=lens,
                       query_ends=query_ends, kv_lens=kv_lens,
                       decode_only=meta.max_query_len == 1, captured=capturing)
    meta.extras[NPU_STEP] = step
    return step


def packing(meta: AttentionMetadata) -> Packing:
    """This step's BSND packing (eager steps with prefill tokens), built once per step."""
    cached: Packing | None = meta.extras.get(NPU_PACKING)
    if cached is not None:
        return cached
    R, T = meta.num_reqs, meta.num_actual_tokens
    starts = meta.query_start_loc_np[:R + 1].astype(np.int64)
    lens = np.diff(starts)
    S = int(lens.max())
    req = np.repeat(np.arange(R), lens)
    scatter = req * S + np.arange(T) - starts[req]
    gather = np.zeros(R * S, np.int64)
    gather[scatter] = np.arange(T)
    device = meta.slot_mapping.device
    pack = Packing(torch.from_numpy(gather).to(device), torch.from_numpy(scatter).to(device), lens.tolist(), S)
    meta.extras[NPU_PACKING] = pack
    return pack


def npu_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
    """`Backend.attention` on torch_npu (module docstring); `[T_pad, Hq, D]`."""
    tnpu = sys.modules.get("torch_npu")
    if (tnpu is None or q.device.type != device_type() or spec.logits_soft_cap is not None
            or kv_cache.dtype != q.dtype):
        return sdpa_paged_attention(q, k, v, kv_cache, meta, spec)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    step = step_tensors(meta, key_cache.shape[1])
    tnpu._npu_reshape_and_cache(key=k.contiguous(), value=v.contiguous(), key_cache=key_cache,
                                value_cache=value_cache, slot_indices=step.slots)
    if step.decode_only:
        rows = step.block_table.shape[0]   # the step's requests (a graph's batch size)
        out = torch.empty_like(q)
        out[rows:] = 0
        if spec.sliding_window is None:
            graph.launch(tnpu, graph.PAGED_ATTENTION, dict(
                query=q[:rows].contiguous(), key_cache=key_cache, value_cache=value_cache,
                num_kv_heads=spec.num_kv_heads, num_heads=spec.num_heads, scale_value=spec.scale,
                block_table=step.block_table, context_lens=step.context_lens, out=out[:rows]))
        else:
            out[:rows] = windowed_decode(tnpu, q[:rows], key_cache, value_cache, meta, spec, step)
        return out
    if spec.sliding_window is None:
        return fused_prefill(tnpu, q, key_cache, value_cache, meta, spec, step)
    return windowed_prefill(tnpu, q, key_cache, value_cache, meta, spec, step)


def _paged_kv(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as the fused op's paged key/value: `[num_blocks, block_size, Hkv * D]`."""
    nb, bs, H, D = key_cache.shape
    return key_cache.view(nb, bs, H * D), value_cache.view(nb, bs, H * D)


def windowed_decode(tnpu: Any, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, spec: LayerSpec, step: StepTensors) -> torch.Tensor:
    """One query token per request through the fused op's `.out`; the window as a device mask."""
    assert spec.sliding_window is not None
    B, Hq, D = q.shape
    bs = key_cache.shape[1]
    kv_s = step.block_table.shape[1] * bs
    lens = meta.seq_lens[:B].clamp(min=1)[:, None]           # padded rows read the null slot
    kpos = torch.arange(kv_s, device=q.device)[None, :]
    mask = (kpos >= lens) | (kpos < lens - spec.sliding_window)
    key, value = _paged_kv(key_cache, value_cache)
    attn = torch.empty(B, 1, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(1, dtype=q.dtype, device=q.device)
    graph.launch(tnpu, graph.FUSED_ATTENTION_OUT, dict(
        query=q.reshape(B, 1, Hq, D), key=key, value=value, atten_mask=mask.view(B, 1, 1, kv_s),
        actual_seq_lengths=[1] * B, actual_seq_lengths_kv=step.kv_lens, block_table=step.block_table,
        num_heads=Hq, scale=spec.scale, input_layout="BSND", num_key_value_heads=spec.num_kv_heads,
        block_size=bs, out=[attn, lse]))
    return attn.view(B, Hq, D)


def fused_prefill(tnpu: Any, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  meta: AttentionMetadata, spec: LayerSpec, step: StepTensors) -> torch.Tensor:
    """The whole ragged batch in one TND `npu_fused_infer_attention_score` call, sparse_mode 3."""
    T = meta.num_actual_tokens
    key, value = _paged_kv(key_cache, value_cache)
    attn, _ = tnpu.npu_fused_infer_attention_score(
        q[:T].contiguous(), key, value, atten_mask=causal_mask(q.device), actual_seq_lengths=step.query_ends,
        actual_seq_lengths_kv=step.kv_lens, block_table=step.block_table, num_heads=spec.num_heads,
        scale=spec.scale, input_layout="TND", num_key_value_heads=spec.num_kv_heads, sparse_mode=3,
        block_size=key_cache.shape[1])
    out = torch.empty_like(q)
    out[:T] = attn
    out[T:] = 0
    return out


def windowed_prefill(tnpu: Any, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     meta: AttentionMetadata, spec: LayerSpec, step: StepTensors) -> torch.Tensor:
    """A sliding-window layer's ragged batch as BSND rows, sparse_mode 4 (band)."""
    assert spec.sliding_window is not None
    T, R = meta.num_actual_tokens, meta.num_reqs
    _, Hq, D = q.shape
    pack = packing(meta)
    key, value = _paged_kv(key_cache, value_cache)
    attn, _ = tnpu.npu_fused_infer_attention_score(
        q[:T][pack.gather].view(R, pack.S, Hq, D), key, value, atten_mask=causal_mask(q.device),
        actual_seq_lengths=pack.query_lens, actual_seq_lengths_kv=step.kv_lens, block_table=step.block_table,
        num_heads=Hq, scale=spec.scale, pre_tokens=spec.sliding_window - 1, next_tokens=0, input_layout="BSND",
        num_key_value_heads=spec.num_kv_heads, sparse_mode=4, block_size=key_cache.shape[1])
    out = torch.empty_like(q)
    out[:T] = attn.view(R * pack.S, Hq, D)[pack.scatter]
    out[T:] = 0
    return out
