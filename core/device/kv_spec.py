"""What the model needs from a KV cache, and how many blocks a budget buys."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """One full-attention KV cache per layer, paged in blocks of `block_size` tokens.

    Logical per-layer shape: `[2, num_blocks, block_size, num_kv_heads, head_size]`.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block in one layer (keys and values)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * elem

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def num_blocks_for(self, budget_bytes: int, alignment: int = 1) -> int:
        """Blocks that fit in `budget_bytes` over all layers, each layer's
        allocation rounded up to `alignment` bytes."""
        per_layer = budget_bytes // self.num_layers
        per_layer -= per_layer % alignment  # an aligned allocation must fit whole
        return int(per_layer // self.page_size_bytes)
