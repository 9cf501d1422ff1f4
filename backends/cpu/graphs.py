"""CPU graphs: a decode step's kernel calls, recorded once and replayed by one C call.

At one token per request a CPU decode step is a chain of C++ kernels (small-M
linears, fused norms, rotary, paged attention) glued by Python, and the glue
costs nearly as much as the kernels (figures:
benchmarks/results/design-measurements.md). `CPUGraphAPI` plugs into the core's
`StaticGraphExecutor` (FULL_DECODE_ONLY graphs over static input buffers, keyed
by batch size) the way CUDA graphs do. `capture(fn)` runs the forward once while

- every kernel call made through `kernel_calls.call` is recorded (kernel id and
  arguments: pointers, sizes, scales), not run: like a CUDA graph capture, it
  computes nothing (captures that ran the kernels cost seconds at start-up);
- `_Vet`, a TorchDispatchMode, sees every torch op: allocations come from one
  arena shared by all graphs (they never run at once; the largest is captured
  first, so the others fit in its blocks), views pass, an embedding lookup
  becomes a recorded row gather, and any other op (a matmul, an add) cannot be
  replayed and fails the capture with its name (the executor then stays eager);

and a replay is `pr_replay` (`graph_replay.cpp`) over the records: no Python,
no allocation. A graph's output lives in the arena until the next replay.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from polyrunner.backends.cpu import kernel_calls
from polyrunner.backends.cpu.kernel_calls import REPLAYABLE, NotReplayable
from polyrunner.plugin_api import GraphAPI, round_up

aten = torch.ops.aten
# ops that only make a new view or read metadata: they run as they are
_VIEWS = {aten.view, aten._unsafe_view, aten.reshape, aten.split, aten.split_with_sizes, aten.slice,
          aten.select, aten.as_strided, aten.t, aten.transpose, aten.unsqueeze, aten.squeeze, aten.expand,
          aten.detach, aten.alias, aten.permute, aten.unbind, aten.narrow, aten.chunk}
# ops that allocate: served from the arena, same sizes, strides and dtype
_ALLOCS = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}


class Arena:
    """Bump allocation over byte blocks, restarted at each capture."""

    ALIGN = 64

    def __init__(self, block_bytes: int = 8 << 20) -> None:
        self.block_bytes = block_bytes
        self.blocks: list[torch.Tensor] = []
        self._block = self._offset = 0

    def restart(self) -> None:
        self._block = self._offset = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 tensor of `nbytes` (64-byte aligned)."""
        nbytes = round_up(max(nbytes, 1), self.ALIGN)
        while True:
            if self._block == len(self.blocks):
                self.blocks.append(torch.empty(max(self.block_bytes, nbytes), dtype=torch.uint8))
            block = self.blocks[self._block]
            if self._offset + nbytes <= block.numel():
                self._offset += nbytes
                return block[self._offset - nbytes:self._offset]
            self._block, self._offset = self._block + 1, 0


class _Vet(TorchDispatchMode):
    """Lets through what a replay repeats or does not need (see the module docstring)."""

    def __init__(self, arena: Arena, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.arena, self.lib = arena, lib

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # no torch.compile runs under a capture: skip the dynamo-disabling wrapper, whose
        # first call imports torch._dynamo (~0.85 s of cold start)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _VIEWS:
            return func(*args, **kwargs)
        if packet in _ALLOCS:
            return self._from_arena(func(*args, **kwargs))
        if packet is aten.embedding:
            return self._gather(*args[:2])
        if func._schema.is_mutable and all(isinstance(a, torch.Tensor) and a.numel() == 0
                                           for a in args if isinstance(a, torch.Tensor)):
            return func(*args, **kwargs)   # an in-place op on nothing (e.g. zeroing no padded rows)
        raise NotReplayable(f"torch op {func} runs outside the C++ kernels and cannot be replayed")

    def _from_arena(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            raise NotReplayable(f"an allocation on {t.device} inside a CPU graph")
        nbytes = t.untyped_storage().nbytes()
        return self.arena.take(nbytes)[:nbytes].view(t.dtype).as_strided(t.shape, t.stride())

    def _gather(self, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if (weight.dim() != 2 or not weight.is_contiguous() or indices.dtype != torch.int64
                or not indices.is_contiguous()):
            raise NotReplayable("an embedding lookup on a strided weight or non-int64 indices")
        out = self._from_arena(torch.empty(indices.shape + weight.shape[1:], dtype=weight.dtype))
        kernel_calls.call(self.lib.pr_gather_rows, weight.data_ptr(), weight.stride(0) * weight.element_size(),
                          indices.data_ptr(), indices.numel(), out.data_ptr())
        return out


def replay_profile(
    lib: ctypes.CDLL, replay: Callable[[], None], repeats: int = 20
) -> list[tuple[str, list[int], float]]:
    """A diagnostic: `(kernel name, its recorded arguments, mean microseconds)` for each
    call of a captured graph (`replay`, from `CPUGraphAPI.capture`), over `repeats` replays."""
    records = replay.records
    ns = np.zeros(len(records), dtype=np.int64)
    for _ in range(repeats):
        if lib.pr_replay_timed(records.ctypes.data, len(records), ns.ctypes.data):
            raise RuntimeError("CPU graph replay reported an error")
    return [(REPLAYABLE[int(r[0]) - 1], r[1:].tolist(), t / repeats / 1e3) for r, t in zip(records, ns)]


class CPUGraphAPI(GraphAPI):
    """`StaticGraphExecutor`'s graph API for the CPU kernels (`lib`: the kernel library)."""

    name = "cpu graphs"

    def __init__(self, lib: ctypes.CDLL) -> None:
        names = tuple(lib.pr_replay_kernel_name(i + 1).decode() for i in range(len(REPLAYABLE)))
        if names != REPLAYABLE:
            raise RuntimeError(f"graph_replay.cpp knows kernels {names}, kernel_calls.py {REPLAYABLE}")
        self.lib = lib
        self.arena = Arena()

    def pool(self) -> Arena:
        return self.arena

    def capture(self, fn: Callable[[], torch.Tensor], pool: Arena) -> tuple[Callable[[], None], torch.Tensor]:
        pool.restart()
        with kernel_calls.record_calls() as record, _Vet(pool, self.lib):
            out = fn()
        records = np.ascontiguousarray(np.asarray(record, dtype=np.int64).reshape(len(record), -1))
        lib, n, address = self.lib, len(record), records.ctypes.data

        def replay(records: np.ndarray = records) -> None:   # the default argument keeps the records alive
            failed = lib.pr_replay(address, n)
            if failed:
                name = REPLAYABLE[int(records[failed - 1, 0]) - 1]
                raise RuntimeError(f"CPU graph replay: call {failed} of {n} ({name}) reported an error")

        replay.records = records   # for replay_profile
        return replay, out

    def free_memory(self) -> int:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 0
