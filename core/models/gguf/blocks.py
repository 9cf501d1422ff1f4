"""A quantized weight matrix whose GGUF blocks stay in the file until a backend reads them.

`QuantizedWeight` names where its rows lie in the GGUF file (`BlockRows`, one per
checkpoint tensor: a fused linear stacks several) and reads them only when asked
(`blocks`). Preparing a model therefore reads nothing: a backend that keeps its own
layout in a cache never reads the GGUF bytes again, and one that converts them does
so one matrix at a time (its memory peak is one matrix, not the model). Rows that lie
in the file as the model needs them (one part, no rotary permutation) come as a view
of the file's pages, never copied.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from polyrunner.models.weight_reader import map_range

__all__ = ["BLOCK_SIZES", "BlockRows", "GGUFSource", "QuantizedWeight", "whole_blocks"]

# GGML type -> (weights per block, bytes per block): the block-quantized types read as blocks.
BLOCK_SIZES = {
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
}


def whole_blocks(qtype: str, shape: Sequence[int], nbytes: int) -> bool:
    """Whether a tensor of `shape` (rows: every dimension but the last) stored in `nbytes` is whole
    blocks of `qtype` (one of `BLOCK_SIZES`) per row."""
    per_block, block_bytes = BLOCK_SIZES.get(qtype, (0, 0))
    *rows, cols = shape
    return bool(per_block) and cols % per_block == 0 and math.prod(rows) * cols // per_block * block_bytes == nbytes


@dataclass(frozen=True)
class GGUFSource:
    """The GGUF file blocks are read from, as it was when they were indexed (size and
    mtime: a backend's cache keyed by `identity` is not reused for a changed file)."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | Path) -> "GGUFSource":
        st = os.stat(path)
        return cls(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)

    @property
    def identity(self) -> str:
        """A short hex key of the file's path, size and mtime."""
        return hashlib.sha256(f"{self.path}\0{self.size}\0{self.mtime_ns}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BlockRows:
    """One checkpoint matrix in the file: `rows` rows of `row_bytes` at byte `offset`, stored
    with llama.cpp's rotary row permutation over `permute_heads` heads (None: in order)."""

    offset: int
    rows: int
    row_bytes: int
    permute_heads: int | None = None


class QuantizedWeight:
    """One weight matrix `[out, in]` (`shape`) in GGUF blocks of GGML type `qtype` (e.g.
    "Q4_K"). `blocks` is uint8 `[out, row_bytes]`, row r holding the blocks of output
    feature r in the model's row order (llama.cpp's rotary permutation undone, a fused
    linear's parts stacked).

    Made either from an array (`QuantizedWeight(qtype, shape, blocks)`) or from where
    the rows lie in a GGUF file (`source`, `parts`); the latter reads at each `blocks`."""

    def __init__(self, qtype: str, shape: tuple[int, int], blocks: np.ndarray | None = None, *,
                 source: GGUFSource | None = None, parts: Sequence[BlockRows] = ()) -> None:
        if (blocks is None) == (source is None):
            raise ValueError("a QuantizedWeight needs either blocks or a source with parts")
        if source is not None and sum(p.rows for p in parts) != shape[0]:
            raise ValueError(f"parts of {sum(p.rows for p in parts)} rows for a {shape[0]}-row weight")
        self.qtype, self.shape = qtype, (int(shape[0]), int(shape[1]))
        self.source, self.parts = source, tuple(parts)
        self._array = blocks

    def __repr__(self) -> str:
        where = f"{len(self.parts)} part(s) of {self.source.path}" if self.source is not None else "in memory"
        return f"QuantizedWeight({self.qtype}, {self.shape}, {where})"

    @property
    def row_bytes(self) -> int:
        return self.parts[0].row_bytes if self.parts else int(self._array.shape[1])   # type: ignore[union-attr]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    @property
    def key(self) -> str | None:
        """What identifies these bytes across processes (the file's identity, the parts' places
        and the type), for a backend's cache; None for blocks given as an array."""
        if self.source is None:
            return None
        places = ",".join(f"{p.offset}:{p.rows}:{p.row_bytes}:{p.permute_heads or 0}" for p in self.parts)
        return f"{self.source.identity}/{self.qtype}/{self.shape[0]}x{self.shape[1]}/{places}"

    @property
    def in_place(self) -> bool:
        """Whether `blocks` views the file's pages (one part, rows in order) rather than a copy."""
        return self.source is None or (len(self.parts) == 1 and not self.parts[0].permute_heads)

    @property
    def blocks(self) -> np.ndarray:
        """The blocks, read now: where `in_place`, a view of a private mapping of the file's bytes
        (copy-on-write; unmapped when the last view goes), else a fresh array the caller owns."""
        if self._array is not None:
            return self._array
        assert self.source is not None
        fd = os.open(self.source.path, os.O_RDONLY)
        try:
            if self.in_place:
                p = self.parts[0]
                return map_range(fd, p.offset, p.rows * p.row_bytes).numpy().reshape(p.rows, p.row_bytes)
            out = _fresh(self.shape[0], self.row_bytes)
            row = 0
            for p in self.parts:
                src = map_range(fd, p.offset, p.rows * p.row_bytes).numpy().reshape(p.rows, p.row_bytes)
                dst = out[row:row + p.rows]
                if p.permute_heads:   # inverse of llama.cpp's permute(w, n_head): (h, half, 2) -> (h, 2, half)
                    h, half = p.permute_heads, p.rows // p.permute_heads // 2
                    dst.reshape(h, 2, half, -1)[...] = src.reshape(h, half, 2, -1).swapaxes(1, 2)
                else:
                    dst[...] = src
                del src
                row += p.rows
            return out
        finally:
            os.close(fd)

    @classmethod
    def stacked(cls, parts: Sequence["QuantizedWeight"], shape: tuple[int, int]) -> "QuantizedWeight":
        """The weights' rows stacked in order (one type, one width), still unread where they are
        all in one file; else their arrays concatenated."""
        sources = {p.source for p in parts}
        if len(parts) == 1:
            return parts[0]
        if None not in sources and len(sources) == 1:
            return cls(parts[0].qtype, shape, source=parts[0].source, parts=[r for p in parts for r in p.parts])
        return cls(parts[0].qtype, shape, np.concatenate([p.blocks for p in parts]))


def _fresh(rows: int, row_bytes: int) -> np.ndarray:
    """A writable uint8 `[rows, row_bytes]` array over an anonymous mapping of its own, unmapped
    when the array goes: its pages leave the process then, even when a worker thread made it (a
    thread's malloc arena keeps freed memory resident: `malloc_trim` does not shrink it)."""
    if rows * row_bytes == 0:
        return np.empty((rows, row_bytes), np.uint8)
    return np.frombuffer(mmap.mmap(-1, rows * row_bytes), np.uint8).reshape(rows, row_bytes)
