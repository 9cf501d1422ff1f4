"""Memory statistics of the emulated device, counted from live tensors (not constants).

The emulated device's memory is the host's, so "allocated" is the bytes of every live tensor
storage (each storage once). The peak between `reset_peak_memory_stats()` and
`max_memory_allocated()` (what the core's KV budget profiles) is metered by watching every op's
outputs meanwhile: a storage that appears is added, and removed when its last tensor dies.
Total memory is `TORCH_NPU_DOUBLE_MEMORY` bytes (default 4 GiB).
"""

from __future__ import annotations

import gc
import os
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

TOTAL_MEMORY = int(os.environ.get("TORCH_NPU_DOUBLE_MEMORY", 4 << 30))


def live_storages() -> dict[int, int]:
    """data pointer -> bytes of every live tensor storage."""
    sizes: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu" and not obj.is_sparse:
            try:   # subclasses (fake, functional tensors a compile left alive) are not device memory
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):   # tensors without storage
                continue
            if ptr:
                sizes[ptr] = max(sizes.get(ptr, 0), storage.nbytes())
    return sizes


class PeakMeter(TorchDispatchMode):
    """Live bytes from a baseline on, and their peak, over the ops run while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.known = live_storages()
        self.current = self.peak = sum(self.known.values())
        self.refs: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if not ptr or (ptr in self.known and ptr not in self.refs):
            return
        if ptr not in self.refs:
            self.known[ptr] = t.untyped_storage().nbytes()
            self.current += self.known[ptr]
            self.peak = max(self.peak, self.current)
            self.refs[ptr] = 0
        self.refs[ptr] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.current -= self.known.pop(ptr)


class DeviceMemory:
    """The `torch.npu` memory statistics of the emulated device."""

    def __init__(self) -> None:
        self.meter: PeakMeter | None = None

    def allocated(self) -> int:
        return self.meter.current if self.meter is not None else sum(live_storages().values())

    def reset_peak(self) -> None:
        self.stop()
        self.meter = PeakMeter()
        self.meter.__enter__()

    def peak(self) -> int:
        """The peak since `reset_peak` (and stop metering), or the live bytes."""
        if self.meter is None:
            return self.allocated()
        peak = self.meter.peak
        self.stop()
        return peak

    def stop(self) -> None:
        meter, self.meter = self.meter, None
        if meter is not None:
            if _get_current_dispatch_mode() is not meter:
                raise RuntimeError("torch_npu double: the memory meter is not the innermost dispatch mode")
            meter.__exit__(None, None, None)

    def mem_get_info(self) -> tuple[int, int]:
        return max(0, TOTAL_MEMORY - self.allocated()), TOTAL_MEMORY


MEMORY = DeviceMemory()
