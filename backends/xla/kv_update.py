"""The KV-cache write of a compiled XLA step: the cache is donated and updated in place.

`torch.compile(backend="openxla")` passes each layer's cache into the graph as an input. An
input that is not marked as a donor cannot share its buffer with the output, so every step
would allocate a new cache and copy all of it (measured on the CPU PJRT device: without
donation the cache's device buffer changes every step; with it, it stays the same).
`update_kv_cache` therefore, as vLLM's TPU attention does:

1. marks the cache as a buffer donor (`torch.ops.xla.dynamo_set_buffer_donor_`, registered
   when torch_xla is imported);
2. computes the updated cache with the registered op `polyrunner_xla::kv_cache_update`
   (functional: `kv_cache.index_copy(0, slot_mapping, kv)`, XLA's scatter);
3. copies it back into the cache tensor itself (`copy_`; not into a view of it, which torch_xla's
   lazy sync would not alias with the input), which XLA turns into an in-place update of the
   donated buffer.

The op is the seam where a device kernel can replace the scatter (vLLM registers a slice-based
Pallas kernel there); here one CompositeExplicitAutograd body serves every device, fake tensors
included. UNVERIFIED ON TPU HARDWARE: the in-place update is checked on the CPU PJRT device
(`tests/test_xla_pallas_trace.py`).

A donated buffer is consumed by the step: lazy work still pending on the old cache when a compiled
step runs would read a deleted buffer ("buffer ... is deleted" at the sync), so the executor syncs
before each compiled step (a no-op while serving; an eager reference run of the model, as the
conformance suite makes, leaves such work). The cache is donated only while dynamo traces: outside
torch.compile (the lazy trace) torch_xla's sync aliases a tensor updated in place with its input
buffer by itself, provided the update lands on the cache tensor itself (step 3).
"""

from __future__ import annotations

import torch

NAMESPACE = "polyrunner_xla"
OP = "kv_cache_update"

_LIB = torch.library.Library(NAMESPACE, "DEF")
_LIB.define(f"{OP}(Tensor kv, Tensor slot_mapping, Tensor kv_cache) -> Tensor")


def _kv_cache_update(kv: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """`kv_cache` with row `slot_mapping[i]` replaced by `kv[i]` (a new tensor)."""
    return kv_cache.index_copy(0, slot_mapping, kv)


_LIB.impl(OP, _kv_cache_update, "CompositeExplicitAutograd")


def donate(kv_cache: torch.Tensor) -> None:
    """While dynamo traces: mark `kv_cache` (a graph input) as a buffer donor (a no-op for
    tensors not on XLA). Outside torch.compile, nothing (module docstring)."""
    if torch.compiler.is_compiling():
        torch.ops.xla.dynamo_set_buffer_donor_(kv_cache, True)


def update_kv_cache(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `kv [T, ...]` into rows `slot_mapping [T]` of `kv_cache` viewed as `[slots, ...]`,
    in place on the donated buffer (the padded tokens write the null slot)."""
    donate(kv_cache)
    flat = kv_cache.view(-1, *kv.shape[1:])
    new = torch.ops.polyrunner_xla.kv_cache_update(kv.to(flat.dtype), slot_mapping, flat)
    kv_cache.copy_(new.view(kv_cache.shape))   # into the base: torch_xla's lazy sync aliases it, a view not
