"""Paged KV blocks: a fixed pool with a reserved null block and a prefix cache.

Block 0 is the null block: never handed out, written by padded tokens, read by
nobody. With prefix caching, a full block is identified by a key chained over
the whole prefix (parent key's hash + the block's tokens); a freed block keeps
its key until it is reused, so a later request with the same prefix can take it
back (reference counted).

Free blocks are handed out in two tiers:
1. blocks without a cached prefix, lowest id first: freed ones before any never
   used (every block ever handed out has a lower id than every never-used one), so
   the pool touches new memory only when it must (a never-touched block may cost
   page faults; a backend's prefault may map blocks in id order), and a request's
   blocks tend to be neighbours, which attention reads faster than scattered ones
   (figures: benchmarks/results/design-measurements.md, "Block order");
2. blocks holding a cached prefix, least recently freed first (vLLM's eviction).
"""

from __future__ import annotations

import heapq
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
        self._plain: list[int] = []            # tier 1: freed blocks without a key, a heap ...
        self._next_fresh = 1                    # ... and the never-used ones, _next_fresh .. num_blocks - 1
        self._cached: OrderedDict[int, None] = OrderedDict()   # tier 2, LRU
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._plain) + (self.num_blocks - self._next_fresh) + len(self._cached)

    @property
    def num_touched_blocks(self) -> int:
        """Blocks ever handed out: ids 1 .. this (the rest were never written)."""
        return self._next_fresh - 1

    def free_blocks(self) -> list[int]:
        """Every free block id, in the order `allocate` would hand them out."""
        return sorted(self._plain) + list(range(self._next_fresh, self.num_blocks)) + list(self._cached)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks in tier order (module docstring); evicts the cache keys of tier 2."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        blocks = [heapq.heappop(self._plain) for _ in range(min(n, len(self._plain)))]
        take = min(n - len(blocks), self.num_blocks - self._next_fresh)
        blocks.extend(range(self._next_fresh, self._next_fresh + take))
        self._next_fresh += take
        for _ in range(n - len(blocks)):
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            blocks.append(block)
        self.ref_cnt[blocks] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become free.
        Pass blocks in request order: of cached prefixes, the tail is evicted first."""
        for block in reversed(blocks):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    heapq.heappush(self._plain, block)

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
                del self._cached[block]
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
