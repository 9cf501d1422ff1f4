"""The persistent batch: one numpy row per running request, kept dense.

Rows survive across steps so per-step work only touches what changed:
`add` fills the lowest hole, `remove` leaves a hole, `condense` moves the last
rows into holes, `reorder_decode_first` swaps the fewest rows so every
single-token (decode) row precedes every prefill row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from polyrunner.runner.block_table import BlockTable

if TYPE_CHECKING:
    from polyrunner.sample import SamplingState


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 block_size: int, sampling: "SamplingState") -> None:
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.num_reqs = 0
        self._holes: list[int] = []
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, max_blocks_per_req, block_size)
        self.sampling = sampling
        self.layout_version = 0   # bumped whenever a request enters, leaves or changes row

    # ---- membership ------------------------------------------------------
    def add(self, req_id: str, prompt_ids: list[int], output_ids: list[int],
            num_computed: int, block_ids: list[int], sampling_args: dict) -> int:
        """Place a request in the lowest free row; returns the row."""
        if self._holes:
            row = min(self._holes)
            self._holes.remove(row)
        else:
            row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        n_prompt = len(prompt_ids)
        n = n_prompt + len(output_ids)
        self.token_ids[row, :n_prompt] = prompt_ids
        self.token_ids[row, n_prompt:n] = output_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens[row] = num_computed
        self.block_table.add_row(row, block_ids)
        self.sampling.add_row(row, **sampling_args)
        self.req_ids[row] = req_id
        self.req_id_to_index[req_id] = row
        self.num_reqs += 1
        self.layout_version += 1
        return row

    def remove(self, req_id: str) -> None:
        """Leave a hole; call `condense()` before preparing inputs."""
        row = self.req_id_to_index.pop(req_id)
        self.req_ids[row] = None
        self.sampling.remove_row(row)
        self._holes.append(row)
        self.num_reqs -= 1
        self.layout_version += 1

    def condense(self) -> None:
        """Move the highest rows into the holes so rows 0..num_reqs-1 are dense."""
        if not self._holes:
            return
        holes = sorted(self._holes)
        self._holes = []
        last = self.num_reqs + len(holes) - 1
        for hole in holes:
            while last >= 0 and self.req_ids[last] is None:
                last -= 1
            if hole >= last:
                break
            self._move(last, hole)
            last -= 1

    def _move(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens):
            arr[dst] = arr[src]
        self.block_table.move_row(src, dst)
        self.sampling.move_row(src, dst)
        req_id = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = dst
        self.layout_version += 1

    def swap(self, a: int, b: int) -> None:
        width = int(max(self.num_tokens[a], self.num_tokens[b]))
        self.token_ids[[a, b], :width] = self.token_ids[[b, a], :width]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens):
            arr[[a, b]] = arr[[b, a]]
        self.block_table.swap_rows(a, b)
        self.sampling.swap_rows(a, b)
        ra, rb = self.req_ids[a], self.req_ids[b]
        self.req_ids[a], self.req_ids[b] = rb, ra
        self.req_id_to_index[rb], self.req_id_to_index[ra] = a, b
        self.layout_version += 1

    def reorder_decode_first(self, num_scheduled: np.ndarray) -> None:
        """Rows with <= 1 scheduled token first, with the fewest swaps.
        `num_scheduled` is indexed by row and is permuted along with the rows."""
        is_decode = num_scheduled[:self.num_reqs] <= 1
        if is_decode.all():
            return
        decodes = np.flatnonzero(is_decode)
        prefills = np.flatnonzero(~is_decode)
        num_decodes = len(decodes)
        for i in range(1, min(num_decodes, len(prefills)) + 1):
            d = decodes[num_decodes - i]
            if d < num_decodes:
                break
            p = prefills[i - 1]
            self.swap(p, d)
            num_scheduled[[p, d]] = num_scheduled[[d, p]]

    # ---- progress ----------------------------------------------------------
    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Append one sampled token to each given row (vectorised)."""
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1  # rows are distinct
