"""BlockPool: the order free blocks are handed out in, and its books under any sequence of calls.

Tiers (block_pool.py): blocks without a cached prefix, lowest id first (so freed ones before
never-used ones); then cached prefixes, least recently freed first.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrunner.engine.block_pool import BlockPool


def key(n: int):
    return (0, (n,))


def test_fresh_blocks_go_out_lowest_id_first():
    pool = BlockPool(8)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.num_touched_blocks == 3 and pool.num_free_blocks == 4
    assert pool.free_blocks() == [4, 5, 6, 7]


def test_freed_blocks_are_reused_lowest_id_first_before_fresh_ones():
    pool = BlockPool(12)
    a, _held, c = pool.allocate(3), pool.allocate(2), pool.allocate(2)   # [1, 2, 3], [4, 5], [6, 7]
    pool.free(c)
    pool.free(a)
    assert pool.free_blocks()[:6] == [1, 2, 3, 6, 7, 8]
    assert pool.allocate(6) == [1, 2, 3, 6, 7, 8]     # block 8 is the first never-used one
    assert pool.num_touched_blocks == 8


def test_cached_prefixes_are_evicted_last_least_recently_freed_first():
    pool = BlockPool(6)
    a = pool.allocate(2)                     # [1, 2]
    pool.cache(a, [key(1), key(2)])
    pool.free(a)                             # cached: the tail (2) queued for eviction first
    b = pool.allocate(1)                     # [3]
    pool.free(b)                             # keyless
    assert pool.free_blocks() == [3, 4, 5, 2, 1]   # keyless 3, never-used 4 and 5, then cached
    assert pool.allocate(4) == [3, 4, 5, 2]  # 2's key evicted, 1's kept
    assert pool.num_cached_prefix([key(1)]) == 1 and pool.num_cached_prefix([key(2)]) == 0
    assert pool.lookup([key(1)]) == [1] and pool.num_free_blocks == 0


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError, match="cannot allocate 4 blocks, 3 free"):
        pool.allocate(4)
    assert pool.free_blocks() == [1, 2, 3]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "lookup"]), st.integers(0, 5)), max_size=60))
def test_books_balance_under_any_sequence(ops):
    """Held and free blocks partition the usable ones; ref counts equal holders; a cached key
    maps to one block and back."""
    pool = BlockPool(12)
    held: list[list[int]] = []
    for op, n in ops:
        if op == "alloc" and n <= pool.num_free_blocks:
            held.append(pool.allocate(n))
        elif op == "free" and held:
            pool.free(held.pop(n % len(held)))
        elif op == "cache" and held:
            blocks = held[n % len(held)]
            pool.cache(blocks, [key(b * 100 + n) for b in blocks])
        elif op == "lookup" and pool.num_cached_blocks():
            cached_key = next(iter(pool._block_of))
            held.append(pool.lookup([cached_key]))
        counts = [0] * pool.num_blocks
        for blocks in held:
            for b in blocks:
                counts[b] += 1
        free = pool.free_blocks()
        assert len(free) == len(set(free)) == pool.num_free_blocks
        assert not set(free) & {b for blocks in held for b in blocks}
        assert len(free) + sum(c > 0 for c in counts) == pool.num_usable_blocks
        assert list(pool.ref_cnt[1:]) == counts[1:] and pool.ref_cnt[0] == 1
        assert all(pool._key_of[b] == k for k, b in pool._block_of.items())
