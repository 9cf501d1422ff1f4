"""Pallas ragged paged attention, for real TPUs only. UNVERIFIED ON TPU HARDWARE.

Selected by `XLABackend.use_pallas` (a TPU was probed and
`POLYRUNNER_XLA_PALLAS` is not "0"); never used on the CPU PJRT device, where
CI runs. Written against torch_xla 2.9's
`torch_xla.experimental.custom_kernel.ragged_paged_attention` (the kernel
vLLM's TPU runner uses), following the TPU reference runner:

- KV layout per layer `[num_blocks, block_size, 2 * num_kv_heads, head_size]`,
  keys and values interleaved per head (combined head 2h = K_h, 2h+1 = V_h);
- the kernel reads `kv_lens [R_max]`, `page_indices [R_max, max_blocks]`,
  `cu_q_lens [R_max + 1]` and `num_seqs [1]`, padded on the host to the
  largest request bucket so the backbone graph depends only on T_pad;
- SMEM limit: the int32 block table must fit half of 1 MiB SMEM, so the
  largest request bucket is capped at `max_num_seqs(max_model_len, block_size)`
  and bigger steps are split into row windows by the runner.

Head sizes that are not a multiple of 128 are padded to one at the op
boundary (`head_pad.py`, `XLABackend.attention`). Known gaps: the KV write is a
plain index_copy rather than the reference's slice-based Pallas update kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from polyrunner.plugin_api import NULL_BLOCK, AttentionMetadata, KVCacheSpec, LayerSpec, cdiv

SMEM_BYTES = 1 << 20
NUM_SEQS = "pallas_num_seqs"


def max_num_seqs(max_model_len: int, block_size: int) -> int:
    """Requests whose int32 block tables fit in half of SMEM."""
    blocks = cdiv(max_model_len, block_size)
    return max(1, (SMEM_BYTES // 2) // blocks // 4)


def kv_cache_shape(spec: KVCacheSpec, num_blocks: int) -> tuple[int, int, int, int]:
    return (num_blocks, spec.block_size, 2 * spec.num_kv_heads, spec.head_size)


def host_inputs(step, max_reqs: int) -> dict[str, np.ndarray]:
    """Kernel metadata padded to `max_reqs` rows (the tails are never read: num_seqs bounds them)."""
    R, T = step.num_reqs, step.num_tokens
    rows = max(max_reqs, R)
    seq_lens = np.zeros(rows, np.int32)
    seq_lens[:R] = step.seq_lens[:R]
    tables = np.full((rows, step.block_tables.shape[1]), NULL_BLOCK, np.int32)
    tables[:R] = step.block_tables[:R]
    qsl = np.full(rows + 1, T, np.int32)
    qsl[:R + 1] = step.query_start_loc[:R + 1]
    return {"pallas_seq_lens": seq_lens, "pallas_block_tables": tables,
            "pallas_query_start_loc": qsl, NUM_SEQS: np.array([R], np.int32)}


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Interleave k/v per head and write them into their slots (padded tokens: the null slot)."""
    T, num_kv, head = k.shape
    kv = torch.stack([k, v], dim=2).reshape(T, 2 * num_kv, head).to(kv_cache.dtype)
    kv_cache.view(-1, 2 * num_kv, head).index_copy_(0, slot_mapping, kv)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              meta: AttentionMetadata, spec: LayerSpec, use_kernel: bool = True) -> torch.Tensor:
    from torch_xla.experimental.custom_kernel import ragged_paged_attention
    write_kv(kv_cache, k, v, meta.slot_mapping)
    e = meta.extras
    return ragged_paged_attention(
        q, kv_cache, e["pallas_seq_lens"], e["pallas_block_tables"], e["pallas_query_start_loc"],
        e[NUM_SEQS], sm_scale=spec.scale, sliding_window=spec.sliding_window, soft_cap=spec.logits_soft_cap,
        use_kernel=use_kernel)
