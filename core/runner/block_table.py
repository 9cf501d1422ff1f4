"""The runner's block table: one row per request slot (numpy), a device-side
copy of the KV manager's block ids kept current from the scheduler's deltas,
and the slot formula."""

from __future__ import annotations

import numpy as np

from polyrunner.attention.metadata import NULL_BLOCK


class BlockTable:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        self.table = np.full((max_num_reqs, max_blocks_per_req), NULL_BLOCK, dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

    def reset_row(self, row: int) -> None:
        self.table[row, :self.num_blocks[row]] = NULL_BLOCK
        self.num_blocks[row] = 0

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            raise ValueError(f"row {row} needs {end} blocks, table width is {self.table.shape[1]}")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """slot = block_table[req, pos // block_size] * block_size + pos % block_size."""
        blocks = self.table[req_indices, positions // self.block_size]
        slots: np.ndarray = blocks.astype(np.int64) * self.block_size + positions % self.block_size
        return slots
