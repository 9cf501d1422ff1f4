"""A stream graph emulated on the CPU: capture records every op, replay re-executes the record.

For testing a plugin's captured steps without its device (a backend's CPU stand-in, a device
library's test double). Like a stream-captured device graph, and unlike re-running the Python
that built it, a replay:

- runs only the ops recorded at capture, on the very tensors they read and wrote (the static
  buffers, the graph's intermediates), so a value the Python read at capture stays frozen
  (a host-side length, a branch taken) and a result written to a tensor the graph does not
  read stays unread (a stale output becomes visible);
- computes nothing new: each op's result is written into the tensor captured as its output
  (a view or an in-place op already is that tensor).

A capture computes the step once (a device's capture need not, so callers must not rely on the
output before a replay). Collectives (c10d ops such as `allreduce_`) are recorded like any op
and waited for at replay. A device library's own ops can join the tape as `Task`s
(`TapeGraph.record`), as a test double's ops do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from polyrunner.device.graphs import GraphAPI

__all__ = ["Task", "TapeGraph", "TapeGraphAPI", "write_back"]


def write_back(old: Any, new: Any) -> None:
    """Copy a replayed op's results `new` into the tensors `old` captured as its outputs."""
    olds, _ = tree_flatten(old)
    news, _ = tree_flatten(new)
    for n in news:   # a collective returns a boxed Work: complete it
        if isinstance(n, torch.ScriptObject):
            torch.distributed.Work.unbox(n).wait()
    for o, n in zip(olds, news):
        if isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor) and o is not n:
            if o.data_ptr() == n.data_ptr() and o.shape == n.shape and o.stride() == n.stride():
                continue   # a view of the same memory (views, in-place ops)
            o.copy_(n)


@dataclass
class Task:
    """One recorded op: `fn(*args, **kwargs)`, whose results are written into `out` at replay."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    out: Any = None

    def replay(self) -> None:
        write_back(self.out, self.fn(*self.args, **self.kwargs))


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, graph: TapeGraph) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.graph = graph

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False   # no torch.compile runs inside: skip the wrapper whose first call imports torch._dynamo

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph.tape.append(Task(func, args, kwargs, out))
        return out


class TapeGraph:
    """One emulated graph: `capture_begin()`, the step's ops, `capture_end()` (or `capture(fn)`);
    then `replay()`."""

    capturing: TapeGraph | None = None   # the graph being captured in this process

    def __init__(self) -> None:
        self.tape: list[Task] = []
        self.replays = 0
        self._recorder: _Recorder | None = None

    def capture_begin(self) -> None:
        if TapeGraph.capturing is not None:
            raise RuntimeError("capture_begin: another graph is being captured")
        self.tape = []
        TapeGraph.capturing = self
        self._recorder = _Recorder(self)
        self._recorder.__enter__()  # type: ignore[no-untyped-call]

    def capture_end(self) -> None:
        assert self._recorder is not None and TapeGraph.capturing is self
        self._recorder.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        TapeGraph.capturing, self._recorder = None, None

    def capture(self, fn: Callable[[], Any]) -> Any:
        """`fn()` captured into this graph (between `capture_begin` and `capture_end`); its result."""
        self.capture_begin()
        try:
            return fn()
        finally:
            self.capture_end()

    def record(self, task: Task) -> None:
        """Append a device library's own op (already run once) to the tape."""
        self.tape.append(task)

    def replay(self) -> None:
        if TapeGraph.capturing is not None:
            raise RuntimeError("replay during a capture")
        with torch.inference_mode():
            for task in self.tape:
                task.replay()
        self.replays += 1


class TapeGraphAPI(GraphAPI):
    """`GraphAPI` over `TapeGraph`s: what a plugin's stream-captured graphs do, on the CPU."""

    name = "tape graphs"

    def __init__(self) -> None:
        self.captures = 0
        self.graphs: list[TapeGraph] = []

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
        graph = TapeGraph()
        out: torch.Tensor = graph.capture(fn)
        self.captures += 1
        self.graphs.append(graph)
        return graph.replay, out

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.graphs)
