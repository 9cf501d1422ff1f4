"""`torch.npu` of the torch_npu test double: the device-module calls the npu backend makes,
on an emulated device whose tensors are CPU tensors (see the package docstring).

Names and signatures follow torch_npu's `torch.npu` (torch_npu/npu/__init__.py, graphs.py,
memory.py, streams.py; the CUDA-like API): device queries, memory statistics, streams and
events (no-ops on one host queue), and graphs: `NPUGraph` (`capture_begin`, `capture_end`,
`replay`), `graph(npu_graph, pool=None, stream=None)`, `graph_pool_handle()`,
`is_current_stream_capturing()` and the task-group update API (`_graph.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from torch_npu import _graph
from torch_npu._graph import STATE, Task, TaskGroupHandle

DEVICE_NAME = "Ascend910B2"
DEVICES = int(os.environ.get("TORCH_NPU_DOUBLE_DEVICES", "2"))   # ranks of a tensor-parallel test
TOTAL_MEMORY = 4 << 30
_current = 0


# ---- devices and memory ---------------------------------------------------------
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


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the emulated device (a fixed `TOTAL_MEMORY`)."""
    return TOTAL_MEMORY, TOTAL_MEMORY


def memory_allocated(device: Any = None) -> int:
    return 0


def max_memory_allocated(device: Any = None) -> int:
    return 0


def memory_reserved(device: Any = None) -> int:
    return 0


def reset_peak_memory_stats(device: Any = None) -> None:
    return None


def empty_cache() -> None:
    return None


# ---- streams and events (one in-order host queue) --------------------------------
class Stream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device

    def wait_stream(self, stream: Stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


_DEFAULT_STREAM = Stream()


def current_stream(device: Any = None) -> Stream:
    return _DEFAULT_STREAM


@contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    yield


# ---- graphs -----------------------------------------------------------------------
def graph_pool_handle() -> tuple[int, int]:
    return (0, 1)


def is_current_stream_capturing() -> bool:
    return STATE.capturing is not None


class NPUGraph:
    """An ACL graph: `capture_begin`/`capture_end` record a tape, `replay` re-executes it."""

    def __init__(self) -> None:
        self.tape: list[Task] = []
        self.replays = 0

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if STATE.capturing is not None:
            raise RuntimeError("capture_begin: another graph is being captured")
        self.tape = []
        STATE.capturing = self
        STATE.recorder = _graph._Recorder(self.tape)
        STATE.recorder.__enter__()

    def capture_end(self) -> None:
        if STATE.group is not None:
            raise RuntimeError("capture_end: a task group is still open (graph_task_group_end missing)")
        assert STATE.recorder is not None
        STATE.recorder.__exit__(None, None, None)
        STATE.capturing, STATE.recorder = None, None

    def replay(self) -> None:
        if STATE.capturing is not None or STATE.updating is not None:
            raise RuntimeError("replay during a capture or a task update")
        with torch.inference_mode():
            for task in self.tape:
                task.replay()
        self.replays += 1

    def reset(self) -> None:
        self.tape = []


@contextmanager
def graph(npu_graph: NPUGraph, pool: Any = None, stream: Stream | None = None,
          capture_error_mode: str = "global") -> Iterator[NPUGraph]:
    npu_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
    try:
        yield npu_graph
    finally:
        npu_graph.capture_end()


def graph_task_group_begin(stream: Stream) -> None:
    if STATE.capturing is None:
        raise RuntimeError("graph_task_group_begin outside a graph capture")
    STATE.group = []


def graph_task_group_end(stream: Stream) -> TaskGroupHandle:
    if STATE.group is None:
        raise RuntimeError("graph_task_group_end without graph_task_group_begin")
    handle, STATE.group = TaskGroupHandle(STATE.group), None
    return handle


def graph_task_update_begin(stream: Stream, handle: TaskGroupHandle) -> None:
    if STATE.capturing is not None:
        raise RuntimeError("graph_task_update_begin while capturing")
    STATE.updating, STATE.update_index = handle.tasks, 0


def graph_task_update_end(stream: Stream) -> None:
    if STATE.updating is None:
        raise RuntimeError("graph_task_update_end without graph_task_update_begin")
    if STATE.update_index != len(STATE.updating):
        raise RuntimeError("graph_task_update_end: not every task of the group was updated")
    STATE.updating = None
