"""The capture guard: nothing inside a captured or compiled step may synchronise with the host.

A stream-captured device graph records device work only: a host read of a device value (`.item()`,
`.tolist()`, `.cpu()`, `if tensor:`) fails the capture on the hardware, or worse, bakes the
capture's value into every replay; an op whose output shape depends on data (`nonzero`,
`bincount`, boolean-mask indexing) needs such a read; a whole-step compiled graph cannot hold either.
On CPU these pass silently, so `capture_guard(device)` refuses them while a step is captured
or traced, and the hardware never sees them first. It is entered by the core's
`StaticGraphExecutor` around every capture (every backend's graphs, and their CPU stand-ins
in tests) and by a backend around its own tracing (a lazy-tensor trace).

What it refuses, with `HostSyncError` naming the op and the way out:

- host reads of device tensors: `Tensor.item/tolist/numpy/cpu`, `.to(<host>)` (on a real device),
  `aten._local_scalar_dense` (`bool(t)`, `int(t)`, `float(t)`);
- ops with data-dependent output shapes: `nonzero`, `argwhere`, `bincount`, `unique*`,
  `masked_select`, `repeat_interleave` without `output_size`, indexing with a boolean mask;
- allocations outside the graph's memory: pinned host memory, a tensor on another device of
  the capture's type, and uploads (a host tensor copied into a device tensor).

What is *host* data: on a real device, every CPU tensor (an op's host-side arguments, such as
an attention op's context lengths, are CPU tensors there). Where the device is emulated on the CPU (a
test double, the CPU backend), tensors cannot tell host from device, so host-side data is
declared with `host_tensor(t)`: the guard lets such tensors be read, and what an op computes
from host tensors alone is host data too.

`in_static_step()` tells core code with a data-dependent fast path (the MoE reference) to take
its fixed-shape path: inside a guard, or while torch.compile traces.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HostSyncError", "capture_guard", "host_tensor", "in_static_step", "is_host_tensor"]

aten = torch.ops.aten
HOST_MARK = "_polyrunner_host"

# Tensor methods that read a device tensor on the host
_HOST_READS = {"item", "tolist", "numpy", "cpu"}
# ops whose output shape depends on tensor values (each needs a device -> host read)
_DYNAMIC_SHAPE = {aten.nonzero, aten.argwhere, aten.bincount, aten.masked_select, aten._unique, aten._unique2,
                  aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive}
_MASK_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostSyncError(RuntimeError):
    """An op inside a captured or compiled step that would synchronise with the host."""


_state = threading.local()


def in_static_step() -> bool:
    """True while a step is captured or traced: core code takes its fixed-shape, sync-free path."""
    return torch.compiler.is_compiling() or getattr(_state, "depth", 0) > 0


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Declare `tensor` host-side data (read on the host by design); returns it."""
    setattr(tensor, HOST_MARK, True)
    return tensor


def is_host_tensor(tensor: torch.Tensor, device: torch.device) -> bool:
    """Host data for a step captured on `device`: declared so, or on the CPU when the device is not."""
    return bool(getattr(tensor, HOST_MARK, False)) or (device.type != "cpu" and tensor.device.type == "cpu")


def _refuse(what: str, why: str) -> HostSyncError:
    return HostSyncError(
        f"{what} inside a captured or compiled step: {why}. A graph replays device work only, so "
        "the op must stay on the device with a fixed shape (keep host values in numpy before the step, "
        "or mark host-side arguments with polyrunner.plugin_api.host_tensor)")


class _Methods(TorchFunctionMode):
    """Tensor methods that never reach the dispatcher (`tolist`) or mean a download (`cpu`, `to`)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and not is_host_tensor(args[0], self.device):
            if name in _HOST_READS:
                raise _refuse(f"Tensor.{name}()", "it reads a device tensor on the host")
            if name == "to" and self.device.type != "cpu" and _targets_host(args[1:], kwargs):
                raise _refuse("Tensor.to(<host>)", "it copies a device tensor to the host")
        return func(*args, **kwargs)


def _targets_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device")
    for a in args:
        if isinstance(a, (str, torch.device)):
            target = a
        elif isinstance(a, torch.Tensor):
            target = a.device
    return target is not None and torch.device(target).type == "cpu"


class _Ops(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every op the step runs: scalar reads, data-dependent shapes, allocations and uploads."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device = device

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False   # no torch.compile runs inside: skip the wrapper whose first call imports torch._dynamo

    def _host(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and is_host_tensor(t, self.device)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_host = bool(tensors) and all(self._host(t) for t in tensors)
        if not on_host:
            if func is aten._local_scalar_dense.default:
                raise _refuse("a scalar read (.item(), bool(t), int(t), float(t))",
                              "it reads a device tensor on the host")
            if packet in _DYNAMIC_SHAPE or (packet is aten.repeat_interleave and kwargs.get("output_size") is None
                                            and func is aten.repeat_interleave.Tensor):
                raise _refuse(f"{packet.__name__}", "its output shape depends on tensor values")
            if packet in _MASK_INDEXING and _bool_index(args):
                raise _refuse("indexing with a boolean mask", "its output shape depends on tensor values")
        if self._upload(packet, args, kwargs):
            raise _refuse("a host-to-device copy", "an upload does not belong in a graph")
        if kwargs.get("pin_memory") or packet is aten._pin_memory:
            raise _refuse(f"{packet.__name__}(pin_memory=True)", "it allocates pinned host memory")
        out = func(*args, **kwargs)
        if on_host:   # what is computed from host data only is host data too
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    host_tensor(t)
        self._check_placement(packet, out)
        return out

    def _upload(self, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """`dst.copy_(host)`, or (on a real device) `host.to(device)`."""
        if packet is aten.copy_:
            return self._host(args[1]) and not self._host(args[0])
        target = kwargs.get("device")
        return (packet is aten._to_copy and self._host(args[0]) and target is not None
                and torch.device(target).type != "cpu")

    def _check_placement(self, packet: Any, out: Any) -> None:
        """Device outputs stay on the capture's device (its graph pool)."""
        if self.device.type == "cpu":
            return
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and t.device.type == self.device.type
                    and self.device.index is not None and t.device.index != self.device.index):
                raise _refuse(f"{packet.__name__} on {t.device}",
                              f"it allocates outside the graph's memory on {self.device}")


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


@contextlib.contextmanager
def capture_guard(device: torch.device | str) -> Iterator[None]:
    """Refuse host syncs while a step for `device` is captured or traced (module docstring).
    Nests; `in_static_step()` is True inside."""
    device = torch.device(device)
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with _Methods(device), _Ops(device):
            yield
    finally:
        _state.depth -= 1
