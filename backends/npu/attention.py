"""Ascend attention through torch_npu, as vllm-ascend runs it (vllm_ascend/attention/attention_v1.py).

- KV write: `_npu_reshape_and_cache` at int32 slots.
- A decode-only step: `_npu_paged_attention` over the batch, context lengths on the host, the
  block table cut to the longest context's blocks (a sliding-window layer: the fused op below,
  which takes the window; vllm-ascend does the same).
- A step with prefill tokens: ONE `npu_fused_infer_attention_score` call for the whole ragged
  batch (decodes included): TND layout over the paged cache, host cumulative query ends and KV
  lengths; sparse_mode 3 (right-down causal) or, for a sliding window, 4 (band: pre_tokens =
  window - 1), with the 2048 x 2048 mask both modes take. No per-request loop.
- Decode graphs (`STATIC_DECODE`): the decode op captured in a task group, its context lengths
  updated before each replay (graph.py). Reads the context's blocks only.
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

import torch

from polyrunner.backends.npu import graph
from polyrunner.backends.npu.device import device_type, npu_module
from polyrunner.plugin_api import STATIC_DECODE, AttentionMetadata, LayerSpec, sdpa_paged_attention

NPU_STEP = "npu_step"        # meta.extras key of the step's `StepTensors`
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
    if step.decode_only and spec.sliding_window is None:
        rows = step.block_table.shape[0]   # the step's requests (a graph's batch size)
        out = torch.empty_like(q)
        out[rows:] = 0
        graph.launch(tnpu, graph.PAGED_ATTENTION, dict(
            query=q[:rows].contiguous(), key_cache=key_cache, value_cache=value_cache,
            num_kv_heads=spec.num_kv_heads, num_heads=spec.num_heads, scale_value=spec.scale,
            block_table=step.block_table, context_lens=step.context_lens, out=out[:rows]))
        return out
    return fused_attention(tnpu, q, key_cache, value_cache, meta, spec, step)


def fused_attention(tnpu: Any, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, spec: LayerSpec, step: StepTensors) -> torch.Tensor:
    """The whole ragged batch in one `npu_fused_infer_attention_score` call (module docstring)."""
    nb, bs, H, D = key_cache.shape
    T = meta.num_actual_tokens
    window = spec.sliding_window
    attn, _ = graph.launch(tnpu, graph.FUSED_ATTENTION, dict(
        query=q[:T].contiguous(), key=key_cache.view(nb, bs, H * D), value=value_cache.view(nb, bs, H * D),
        atten_mask=causal_mask(q.device), actual_seq_lengths=step.query_ends,
        actual_seq_lengths_kv=step.kv_lens, block_table=step.block_table, num_heads=spec.num_heads,
        scale=spec.scale, pre_tokens=window - 1 if window is not None else 2147483647, next_tokens=0,
        input_layout="TND", num_key_value_heads=spec.num_kv_heads, sparse_mode=4 if window is not None else 3,
        block_size=bs))
    out = torch.empty_like(q)
    out[:T] = attn
    out[T:] = 0
    return out
