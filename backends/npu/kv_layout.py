"""Ascend KV-cache layout: separate, 2 MiB-aligned K and V buffers behind the
core's logical `[2, num_blocks, block_size, kv_heads, head_size]` tensor.

Ascend kernels (`_npu_reshape_and_cache`, `_npu_paged_attention`) take a key
cache and a value cache, each `[num_blocks, block_size, kv_heads, head_size]`
and contiguous, and KV transfer (llmdatadist) needs 2 MiB-aligned addresses.
Per layer we allocate ONE raw int8 buffer: K in the first half, V in the
second, each half padded up to the alignment and starting on an aligned
address. The layer's tensor is an `as_strided` view of that buffer with
`stride[0]` = the padded half, so `kv[0]` and `kv[1]` are the two contiguous
device caches and the logical indexing of the core still works.

Device-neutral: `allocate_split_kv(..., device="cpu")` builds the same layout
on the host (used by the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrunner.plugin_api import KVCacheSpec, round_up

ALIGNMENT = 2 * 1024 * 1024


@dataclass(frozen=True)
class SplitKVLayout:
    """Byte layout of one layer: K at 0, V at `half_bytes`, total `layer_bytes`."""

    elem_bytes: int
    raw_half_bytes: int   # bytes of one of K or V
    half_bytes: int       # padded to the alignment
    layer_bytes: int      # 2 * half_bytes

    @classmethod
    def of(cls, spec: KVCacheSpec, num_blocks: int, alignment: int = ALIGNMENT) -> "SplitKVLayout":
        elem = torch.empty((), dtype=spec.dtype).element_size()
        raw = num_blocks * spec.block_size * spec.num_kv_heads * spec.head_size * elem
        half = round_up(raw, alignment)
        return cls(elem, raw, half, 2 * half)


def aligned_raw(nbytes: int, alignment: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed int8 tensor of `nbytes` whose address is a multiple of `alignment`.
    Over-allocates by one alignment only when the allocator's address is not aligned."""
    raw = torch.zeros(nbytes, dtype=torch.int8, device=device)
    if raw.data_ptr() % alignment == 0:
        return raw
    raw = torch.zeros(nbytes + alignment, dtype=torch.int8, device=device)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset: offset + nbytes]


def split_kv_view(raw: torch.Tensor, spec: KVCacheSpec, num_blocks: int,
                  layout: SplitKVLayout) -> torch.Tensor:
    """The logical `[2, nb, bs, H, D]` view of a raw K|V buffer."""
    typed = raw.view(spec.dtype)
    bs, H, D = spec.block_size, spec.num_kv_heads, spec.head_size
    return typed.as_strided((2, num_blocks, bs, H, D),
                            (layout.half_bytes // layout.elem_bytes, bs * H * D, H * D, D, 1))


def split_kv_num_blocks(spec: KVCacheSpec, budget_bytes: int, alignment: int = ALIGNMENT) -> int:
    """Blocks whose split layout fits `budget_bytes`: per layer, K and V each
    rounded up to the alignment, plus one alignment reserved in case the
    allocator's address must be aligned by over-allocating."""
    per_layer = budget_bytes // spec.num_layers - alignment
    half = (per_layer // 2) // alignment * alignment
    block_bytes = spec.page_size_bytes // 2
    return max(0, half // block_bytes)


def allocate_split_kv(spec: KVCacheSpec, num_blocks: int, device: torch.device | str,
                      alignment: int = ALIGNMENT) -> list[torch.Tensor]:
    """One aligned K|V buffer per layer, returned as logical views (zeroed)."""
    layout = SplitKVLayout.of(spec, num_blocks, alignment)
    return [split_kv_view(aligned_raw(layout.layer_bytes, alignment, device), spec, num_blocks, layout)
            for _ in range(spec.num_layers)]
