"""Host -> device uploads through persistent pinned buffers: nothing is pinned inside a step.

`PinnedStaging` keeps one pinned host arena in two halves, used in turn. `upload(tensor)`
copies the host tensor into the current half (64-byte aligned) and starts a non-blocking
copy to the device from there. When an upload does not fit, the staging records an event on
the current stream behind the half's copies and moves to the other half, first waiting for
that half's own event (recorded a whole half of uploads earlier, so in a steady state it has
long completed): a copy in flight never reads bytes that changed. An upload larger than a half
grows the arena (both halves waited for, then replaced): the arena is allocated at most once
per doubling, so after the first steps at the largest shape it is never allocated again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

ALIGN = 64


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedStaging:
    """Uploads to `device` staged through a reused pinned arena (`mod`: the device's torch
    module, whose `Event` orders the halves' reuse). Thread-safe; one per device is enough."""

    def __init__(self, mod: Any, device: torch.device | str, half_bytes: int = 4 << 20,
                 alloc: Callable[[int], torch.Tensor] = _pinned,
                 copy: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None) -> None:
        self.mod, self.device = mod, torch.device(device)
        self._alloc = alloc
        self._copy = copy or (lambda buf, dev: buf.to(dev, non_blocking=True))
        self._lock = threading.Lock()
        self.allocations = 0   # arena (re)allocations so far: 1 + the number of growths
        self._grow(half_bytes)

    def _grow(self, half_bytes: int) -> None:
        self._halves = [self._alloc(half_bytes), self._alloc(half_bytes)]
        self._events: list[Any] = [None, None]
        self._current, self._used = 0, 0
        self.allocations += 1

    @property
    def half_bytes(self) -> int:
        return self._halves[0].numel()

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (host) on the device; the host tensor may change as soon as this returns."""
        if tensor.device.type != "cpu" or tensor.is_pinned():
            return self._copy(tensor, self.device)
        n = tensor.numel() * tensor.element_size()
        if n == 0:
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        with self._lock:
            size = -(-n // ALIGN) * ALIGN
            if self._used + size > self.half_bytes:
                self._next_half(size)
            start, self._used = self._used, self._used + size
            buf = self._halves[self._current][start:start + n].view(tensor.dtype).view(tensor.shape)
            buf.copy_(tensor)
            return self._copy(buf, self.device)

    def _next_half(self, size: int) -> None:
        """Close the current half behind an event; open the other (or a grown arena) once free."""
        event = self.mod.Event()
        event.record()
        self._events[self._current] = event
        if size > self.half_bytes:
            for e in self._events:
                if e is not None:
                    e.synchronize()
            half = self.half_bytes
            while half < size:
                half *= 2
            self._grow(half)
            return
        self._current = 1 - self._current
        waiting = self._events[self._current]
        if waiting is not None:
            waiting.synchronize()
        self._used = 0
