"""ACL graphs of the torch_npu double, on the core's CPU stream-graph emulation
(polyrunner.device.tape_graph): capture records, replay re-executes the record.

- `NPUGraph` is a `TapeGraph`: under `torch.npu.graph(g)` every aten op is recorded with the very
  tensors it read and wrote, and every torch_npu op is recorded as one `OpTask`. `replay()`
  re-executes the record into the recorded buffers: the Python that built the graph does not run
  again, a host value read at capture stays frozen, and a result written where the graph does
  not read stays unread (a stale output is visible).
- A capture refuses host synchronisations (`.item()`, `.tolist()`, ...), as an ACL capture does:
  it runs under the core's capture guard (polyrunner.device.capture_guard), entered here unless
  the caller (the core's graph executor) already did.
- Host arguments of a torch_npu op (what its documentation says is read on the host:
  `_npu_paged_attention`'s `context_lens`, the fused op's `actual_seq_lengths(_kv)`) are copied
  into the task at capture: on the device they are baked into the task's tiling.
- Task groups and updates (op-plugin docs/context/torch_npu-npu-graph_task_group_begin.md,
  _group_end.md, _update_begin.md, _update_end.md): `graph_task_group_begin(stream)` ..
  `graph_task_group_end(stream) -> handle` around a captured op; later, on an update stream,
  `graph_task_update_begin(stream, handle)`, the op's call, `graph_task_update_end(stream)`: the
  op does not run, it re-binds the captured task's arguments (`OpTask.rebind`).
- `ExternalEvent` (docs/context/torch_npu-npu-ExternalEvent*.md): `wait(stream)` during a capture
  puts a wait node in the graph; the replay blocks there until the event is recorded (here: a
  replay that reaches an unrecorded event raises, where the device would hang), and the wait
  resets the event. The documented update protocol: the graph waits on an event before each
  updatable task group, the update runs on its own stream and records the event after
  `graph_task_update_end` (the graph_task_update_end.md example; vllm-ascend's
  update_attn_params, vllm_ascend/compilation/acl_graph.py and attention/attention_v1.py).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from polyrunner.device.capture_guard import capture_guard, host_tensor, in_static_step
from polyrunner.device.tape_graph import TapeGraph, Task, write_back

CALLS: Counter[str] = Counter()         # torch_npu op -> eager calls (captures included, updates not)
REPLAYS: Counter[str] = Counter()       # torch_npu op -> executions by graph replays
LAST: dict[str, dict[str, Any]] = {}    # torch_npu op -> its last execution's arguments


class GraphError(RuntimeError):
    """What the device refuses (or would hang on) in a graph capture, update or replay."""


@contextlib.contextmanager
def emulating() -> Iterator[None]:
    """The double computing an op "on the device": no recording, no capture guard."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


# ---- streams ---------------------------------------------------------------------------
class Stream:
    """An NPU stream (one in-order host queue here)."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device

    def wait_stream(self, stream: Stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


DEFAULT_STREAM = Stream()
_streams: list[Stream] = []


def current_stream(device: Any = None) -> Stream:
    return _streams[-1] if _streams else DEFAULT_STREAM


@contextlib.contextmanager
def use_stream(s: Stream | None) -> Iterator[None]:
    """`torch.npu.stream(s)`: `s` is the current stream inside (None: unchanged)."""
    if s is None:
        yield
        return
    _streams.append(s)
    try:
        yield
    finally:
        _streams.pop()


stream = use_stream   # torch.npu's name


# ---- events ------------------------------------------------------------------------------
class ExternalEvent:
    """torch_npu.npu.ExternalEvent: an AscendCL event a graph captures as an external node."""

    def __init__(self) -> None:
        self.recorded = False

    def wait(self, stream: Stream) -> None:
        graph = capturing()
        if graph is None:   # outside a graph: blocks the stream until recorded
            if not self.recorded:
                raise GraphError("ExternalEvent.wait outside a graph on an event never recorded: the stream "
                                 "would wait forever")
            self.recorded = False
            return
        _check_stream(stream, graph)
        graph.record(EventWait(_noop, event=self))

    def reset(self, stream: Stream) -> None:
        graph = capturing()
        if graph is None:
            self.recorded = False
            return
        _check_stream(stream, graph)
        graph.record(EventReset(_noop, event=self))

    def record(self, stream: Stream) -> None:
        graph = capturing()
        if graph is not None:   # a record node of the graph
            _check_stream(stream, graph)
            graph.record(EventRecord(_noop, event=self))
            return
        if STATE.updating is not None:
            raise GraphError("ExternalEvent.record between graph_task_update_begin and _end: record it after "
                             "graph_task_update_end, or the replay may run the task before its update")
        self.recorded = True


def _noop() -> None:
    return None


@dataclass
class EventWait(Task):
    """A captured `ExternalEvent.wait`: the replay waits for the record, which resets the event."""

    event: ExternalEvent | None = None

    def replay(self) -> None:
        assert self.event is not None
        if not self.event.recorded:
            raise GraphError("ACL graph replay reached an ExternalEvent wait whose event was never recorded: "
                             "record it on the update stream after graph_task_update_end (on the device the "
                             "replay would hang here)")
        self.event.recorded = False


@dataclass
class EventReset(Task):
    event: ExternalEvent | None = None

    def replay(self) -> None:
        assert self.event is not None
        self.event.recorded = False


@dataclass
class EventRecord(Task):
    event: ExternalEvent | None = None

    def replay(self) -> None:
        assert self.event is not None
        self.event.recorded = True


# ---- torch_npu ops as graph tasks ----------------------------------------------------------
@dataclass
class OpTask(Task):
    """A captured torch_npu op: `fn(**kwargs)`, its results written into `out` at replay.
    `workspace_bytes`: what the task runs with (its `workspace=`, or what the op sized for itself
    at capture); `functional`: the op returns its results (no `out=` argument)."""

    name: str = ""
    workspace_bytes: int = 0
    explicit_workspace: bool = False
    functional: bool = False
    event: ExternalEvent | None = None   # the event the graph waits on before this task (its group's)

    def replay(self) -> None:
        REPLAYS[self.name] += 1
        LAST[self.name] = dict(self.kwargs)
        with emulating():
            result = self.fn(**self.kwargs)
        write_back(self.out, result)

    def rebind(self, kwargs: dict[str, Any], workspace_needed: int) -> Any:
        """A task update: the op does not run; the task takes `kwargs`. A functional op's update
        call returns fresh outputs, which the task writes from now on (the graph reads the old)."""
        given = kwargs.get("workspace")
        if self.explicit_workspace and given is None:
            raise GraphError(f"graph_task_update: {self.name} was captured with workspace= and is re-issued "
                             "without it; pass the workspace sized at capture")
        have = nbytes(given) if given is not None else self.workspace_bytes
        if workspace_needed > have:
            how = "its workspace=" if given is not None else "the workspace the op sized at capture (no workspace=)"
            raise GraphError(f"graph_task_update: {self.name} needs a {workspace_needed}-byte workspace for these "
                             f"lengths, {how} has {have} bytes: size it once at capture for the largest context "
                             "and pass it at capture and at every update")
        self.kwargs = kwargs
        if not self.functional:
            return kwargs.get("out")
        fresh = [torch.empty_like(t) for t in self.out] if isinstance(self.out, (list, tuple)) else \
            torch.empty_like(self.out)
        self.out = fresh
        return tuple(fresh) if isinstance(fresh, list) else fresh


@dataclass
class TaskGroupHandle:
    """What `graph_task_group_end` returns: the torch_npu tasks captured in the group, and the
    ExternalEvent the graph waits on right before the group (None: unguarded)."""

    tasks: list[OpTask]
    event: ExternalEvent | None
    stream: Stream


@dataclass
class State:
    """The open task group (capture) and the task group being updated."""

    group: list[OpTask] | None = None
    group_event: ExternalEvent | None = None
    group_stream: Stream | None = None
    updating: TaskGroupHandle | None = None
    update_stream: Stream | None = None
    update_index: int = 0


STATE = State()


class NPUGraph(TapeGraph):
    """An ACL graph (`capture_begin` / `capture_end` / `replay` / `reset`), emulated on a tape."""

    def __init__(self) -> None:
        super().__init__()
        self.stream: Stream = DEFAULT_STREAM
        self._guard: contextlib.AbstractContextManager[None] | None = None

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        super().capture_begin()
        self.stream = current_stream()
        if not in_static_step():   # the caller's guard is already there (the core's executor)
            self._guard = capture_guard(torch.device("cpu"))
            self._guard.__enter__()

    def capture_end(self) -> None:
        open_group = STATE.group is not None
        STATE.group = None
        if self._guard is not None:
            self._guard.__exit__(None, None, None)
            self._guard = None
        super().capture_end()
        if open_group:
            raise GraphError("capture_end: a task group is still open (graph_task_group_end missing)")

    def replay(self) -> None:
        if STATE.updating is not None:
            raise GraphError("replay between graph_task_update_begin and graph_task_update_end")
        super().replay()

    def reset(self) -> None:
        self.tape = []


def capturing() -> NPUGraph | None:
    graph = TapeGraph.capturing
    return graph if isinstance(graph, NPUGraph) else None


def _check_stream(s: Stream, graph: NPUGraph) -> None:
    if s is not graph.stream:
        raise GraphError("the stream argument is not the stream the graph is being captured on")


def graph_pool_handle() -> tuple[int, int]:
    return (0, 1)


def is_current_stream_capturing() -> bool:
    return capturing() is not None


@contextlib.contextmanager
def graph(npu_graph: NPUGraph, pool: Any = None, stream: Stream | None = None,
          capture_error_mode: str = "global") -> Iterator[NPUGraph]:
    """`torch.npu.graph`: captures on `stream` (default: a side stream of its own), as torch_npu does."""
    with use_stream(stream or Stream()):
        npu_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
        try:
            yield npu_graph
        finally:
            npu_graph.capture_end()


def graph_task_group_begin(stream: Stream) -> None:
    graph = capturing()
    if graph is None:
        raise GraphError("graph_task_group_begin outside a graph capture")
    _check_stream(stream, graph)
    if STATE.group is not None:
        raise GraphError("graph_task_group_begin: a task group is already open")
    STATE.group, STATE.group_stream, STATE.group_event = [], stream, _guarding_event(graph.tape)


def _guarding_event(tape: list[Task]) -> ExternalEvent | None:
    """The event the graph waits on right before this point (a wait, then a reset as vllm-ascend
    does, or a wait alone as the docs do), or None."""
    for task in reversed(tape):
        if isinstance(task, EventWait):
            return task.event
        if not isinstance(task, EventReset):
            return None
    return None


def graph_task_group_end(stream: Stream) -> TaskGroupHandle:
    if STATE.group is None:
        raise GraphError("graph_task_group_end without graph_task_group_begin")
    if stream is not STATE.group_stream:
        raise GraphError("graph_task_group_end: not the stream of graph_task_group_begin")
    for task in STATE.group:
        task.event = STATE.group_event
    handle = TaskGroupHandle(STATE.group, STATE.group_event, stream)
    STATE.group = None
    return handle


def graph_task_update_begin(stream: Stream, handle: TaskGroupHandle) -> None:
    if capturing() is not None:
        raise GraphError("graph_task_update_begin while capturing")
    if STATE.updating is not None:
        raise GraphError("graph_task_update_begin: another update is open")
    if stream is not current_stream() or stream is DEFAULT_STREAM or stream is handle.stream:
        raise GraphError("graph_task_update_begin: run the update on its own stream, current inside "
                         "torch.npu.stream(update_stream) (torch_npu-npu-graph_task_update_end.md example)")
    if handle.event is None:
        raise GraphError("graph_task_update_begin: the task group is not guarded by an ExternalEvent wait; "
                         "the replay could run the task before its update (capture event.wait(stream) right "
                         "before graph_task_group_begin)")
    STATE.updating, STATE.update_stream, STATE.update_index = handle, stream, 0


def graph_task_update_end(stream: Stream) -> None:
    if STATE.updating is None:
        raise GraphError("graph_task_update_end without graph_task_update_begin")
    if stream is not STATE.update_stream:
        raise GraphError("graph_task_update_end: not the stream of graph_task_update_begin")
    if STATE.update_index != len(STATE.updating.tasks):
        raise GraphError("graph_task_update_end: not every task of the group was updated")
    STATE.updating = None


def run_op(name: str, fn: Callable[..., Any], call: dict[str, Any], host: tuple[str, ...],
           workspace_needed: int, functional: bool) -> Any:
    """Execute torch_npu op `name` eagerly, under capture (recorded as a task), or as a task update."""
    if STATE.updating is not None:
        tasks = STATE.updating.tasks
        if STATE.update_index >= len(tasks) or tasks[STATE.update_index].name != name:
            raise GraphError(f"graph_task_update: {name} is not the op captured in this task group")
        task = tasks[STATE.update_index]
        STATE.update_index += 1
        return task.rebind(_freeze(call, host), workspace_needed)
    CALLS[name] += 1
    LAST[name] = call
    graph = capturing()
    if graph is None:
        with emulating():
            return fn(**call)
    frozen = _freeze(call, host)
    given = frozen.get("workspace")
    task = OpTask(fn, (), frozen, None, name=name, functional=functional, explicit_workspace=given is not None,
                  workspace_bytes=nbytes(given) if given is not None else workspace_needed)
    with emulating():
        task.out = fn(**frozen)
    graph.record(task)
    if STATE.group is not None:
        STATE.group.append(task)
    return task.out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _freeze(call: dict[str, Any], host: tuple[str, ...]) -> dict[str, Any]:
    """`call` with its host-side arguments copied (later changes by the caller are not seen; the
    copy is not recorded, so a replay does not copy them again)."""
    frozen = dict(call)
    with emulating():
        for name in host:
            value = frozen.get(name)
            if isinstance(value, torch.Tensor):
                frozen[name] = host_tensor(value.clone())
            elif isinstance(value, (list, tuple)):
                frozen[name] = list(value)
    return frozen
