"""`torch.npu` of the torch_npu double: the device-module calls the npu backend makes, on an
emulated device whose tensors are CPU tensors (see the package docstring).

Names and signatures follow torch_npu's `torch.npu` (torch_npu/npu/__init__.py, graphs.py,
memory.py, streams.py; the CUDA-like API): device queries, memory statistics counted from live
tensors (`_memory.py`), streams (`torch.npu.stream(s)` makes `s` current) and events, and graphs
(`_graph.py`): `NPUGraph`, `graph(npu_graph, pool=None, stream=None)`, `graph_pool_handle()`,
`is_current_stream_capturing()`, the task-group update API and `ExternalEvent`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from torch_npu._graph import (  # noqa: F401 - torch.npu's names
    ExternalEvent,
    NPUGraph,
    Stream,
    current_stream,
    graph,
    graph_pool_handle,
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
    is_current_stream_capturing,
    use_stream,
)
from torch_npu._memory import MEMORY

DEVICE_NAME = "Ascend910B2"
DEVICES = int(os.environ.get("TORCH_NPU_DOUBLE_DEVICES", "2"))   # ranks of a tensor-parallel test
_current = 0


# ---- devices ------------------------------------------------------------------------
def is_available() -> bool:
    return True


def device_count() -> int:
    return DEVICES


def current_device() -> int:
    return _current


def set_device(device: int | str | torch.device) -> None:
    global _current
    index = device if isinstance(device, int) else torch.device(device).index or 0
    if not 0 <= index < device_count():
        raise RuntimeError(f"invalid NPU device {index}")
    _current = index


def get_device_name(device: int | None = None) -> str:
    return DEVICE_NAME


def synchronize(device: Any = None) -> None:
    return None


# ---- memory ------------------------------------------------------------------------------
def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: total minus the live tensors' bytes."""
    return MEMORY.mem_get_info()


def memory_allocated(device: Any = None) -> int:
    return MEMORY.allocated()


def max_memory_allocated(device: Any = None) -> int:
    return MEMORY.peak()


def memory_reserved(device: Any = None) -> int:
    return MEMORY.allocated()


def reset_peak_memory_stats(device: Any = None) -> None:
    MEMORY.reset_peak()


def empty_cache() -> None:
    return None


# ---- events (one in-order host queue) -----------------------------------------------------
class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


stream = use_stream   # torch.npu.stream(s): `s` is the current stream inside
