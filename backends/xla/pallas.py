"""Pallas ragged paged attention, for real TPUs only. UNVERIFIED ON TPU HARDWARE.

Selected by `XLABackend.use_pallas` (a TPU was probed and
`POLYRUNNER_XLA_PALLAS` is not "0"); never used on the CPU PJRT device, where
CI runs, except by tests that register a CPU body for the kernel. Written against
torch_xla 2.9's registered op `torch.ops.xla.ragged_paged_attention` (defined by
`torch_xla.experimental.custom_kernel`), the call vLLM's TPU attention makes,
following the TPU reference runner:

- the step calls the registered op, never torch_xla's Python wrapper: dynamo
  records it as one node, its shape from the op's CompositeExplicitAutograd body
  (`empty_like(q)`), and only the openxla bridge, when it lowers the graph once per
  bucket, runs the XLA body that traces the JAX kernel (the wrapper called inside
  `torch.compile` would be traced by dynamo, and start the runtime client and lower
  the kernel at call time);
- KV layout per layer `[num_blocks, block_size, 2 * num_kv_heads, head_size]`,
  keys and values interleaved per head (combined head 2h = K_h, 2h+1 = V_h),
  written by `kv_update.update_kv_cache` (the cache donated, updated in place);
- the kernel reads `kv_lens [R_max]`, `page_indices [R_max, max_blocks]`,
  `cu_q_lens [R_max + 1]` and `num_seqs [1]`, padded on the host to the
  largest request bucket so the backbone graph depends only on T_pad;
- SMEM limit: the int32 block table must fit half of 1 MiB SMEM, so the
  largest request bucket is capped at `max_num_seqs(max_model_len, block_size)`
  and bigger steps are split into row windows by the runner.

Head sizes that are not a multiple of 128 are padded to one at the op
boundary (`head_pad.py`, `XLABackend.attention`). Checked on the CPU PJRT device with
the kernel's XLA body replaced by a fixed-shape torch reference under the same op
(`tests/test_xla_pallas_trace.py`: the compiled step holds the op, no graph break, no
recompilation, the cache updated in place). Known gap: the KV write is XLA's scatter
(`kv_update.py`) rather than vLLM's slice-based Pallas update kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from polyrunner.backends.xla.kv_update import update_kv_cache
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
    """Interleave k/v per head and write them into their slots (padded tokens: the null slot), in
    place on the donated cache (`kv_update.update_kv_cache`)."""
    T, num_kv, head = k.shape
    update_kv_cache(kv_cache, torch.stack([k, v], dim=2).reshape(T, 2 * num_kv, head), slot_mapping)


def define_ops() -> None:
    """Define `torch.ops.xla.ragged_paged_attention` (torch_xla's `custom_kernel` module does, at
    import); called before any step is traced."""
    import torch_xla.experimental.custom_kernel  # noqa: F401


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              meta: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
    """Write this step's k/v, then `torch.ops.xla.ragged_paged_attention` over the cache
    (`define_ops` has run)."""
    write_kv(kv_cache, k, v, meta.slot_mapping)
    e = meta.extras
    out: torch.Tensor = torch.ops.xla.ragged_paged_attention(
        q, kv_cache, e["pallas_seq_lens"], e["pallas_block_tables"], e["pallas_query_start_loc"], e[NUM_SEQS],
        sm_scale=spec.scale, sliding_window=spec.sliding_window, soft_cap=spec.logits_soft_cap, use_kernel=True)
    return out
