"""Paged KV blocks: a fixed pool with a reserved null block and a prefix cache.

Block 0 is the null block: never handed out, written by padded tokens, read by
nobody. Free blocks wait in LRU order. With prefix caching, a full block is
identified by a key chained over the whole prefix (parent key's hash + the
block's tokens); a freed block keeps its key until it is reused, so a later
request with the same prefix can take it back (reference counted).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from polyrunner.attention.metadata import NULL_BLOCK

BlockKey = tuple[int, tuple[int, ...]]


def chain_keys(token_ids: list[int], block_size: int, parent: int = 0, start_block: int = 0,
               num_blocks: int | None = None) -> list[BlockKey]:
    """Keys of the full blocks `start_block ..` of `token_ids`, chained from `parent`."""
    n_full = len(token_ids) // block_size if num_blocks is None else num_blocks
    keys = []
    for b in range(start_block, n_full):
        key = (parent, tuple(token_ids[b * block_size:(b + 1) * block_size]))
        keys.append(key)
        parent = hash(key)
    return keys


@dataclass
class PrefixCacheStats:
    hit_tokens: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        self.ref_cnt[NULL_BLOCK] = 1  # never free
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks, least recently freed first; evicts their cache keys."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._block_of[key]
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become free.
        Pass blocks in request order: the tail is queued for eviction first."""
        for block in reversed(blocks):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None

    # ---- prefix cache ---------------------------------------------------
    def num_cached_prefix(self, keys: list[BlockKey]) -> int:
        """How many leading `keys` are cached (takes no reference)."""
        n = 0
        while n < len(keys) and keys[n] in self._block_of:
            n += 1
        return n

    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """The cached blocks of the longest prefix of `keys`; takes a reference on each."""
        hits = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        for block in hits:
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1
        return hits

    def cache(self, blocks: list[int], keys: list[BlockKey]) -> None:
        """Register full blocks under their keys (first writer wins)."""
        if not self.enable_prefix_caching:
            return
        for block, key in zip(blocks, keys):
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key

    def num_cached_blocks(self) -> int:
        return len(self._block_of)
