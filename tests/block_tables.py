"""Random paged-KV block tables for attention tests."""

from __future__ import annotations

import numpy as np


def random_block_tables(rng: np.random.Generator, ctx: list[int], block_size: int, num_blocks: int,
                        rows: int, width: int) -> np.ndarray:
    """`[rows, width]` int32 tables: request r's ceil(ctx[r] / block_size) blocks drawn at random
    without overlap from blocks 1..num_blocks-1 (block 0 is the null block); the rest zero."""
    free = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((rows, width), np.int32)
    used = 0
    for r, L in enumerate(ctx):
        nb = -(-L // block_size)
        tables[r, :nb] = free[used:used + nb]
        used += nb
    return tables
