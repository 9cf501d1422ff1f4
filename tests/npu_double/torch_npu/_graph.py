"""ACL graph emulation for the torch_npu test double: capture records, replay re-executes.

Under `torch.npu.graph(g)` every aten op the captured code runs is recorded on `g`'s tape
(a TorchDispatchMode) with the very tensors it read and wrote, and every torch_npu op is
recorded as one task with its arguments. `g.replay()` re-executes the tape in order on the
same tensors (the static buffers), writing each op's result into the tensors captured as its
outputs; the Python code that built the graph does not run again, as on the device.

Host-side arguments of a torch_npu op (the ones its documentation says are read on the host,
e.g. `_npu_paged_attention`'s `context_lens`, `npu_fused_infer_attention_score`'s
`actual_seq_lengths`) are frozen (copied) when the task is captured: on the device they are
baked into the task's tiling. The only way to change them is torch_npu's task update
(torch_npu/csrc/core/npu/NPUGraph.h: `graph_task_group_begin(stream)`,
`graph_task_group_end(stream) -> handle`, `graph_task_update_begin(stream, handle)`,
`graph_task_update_end(stream)`): the op called between update begin and end does not run,
it re-binds the arguments of the task captured in that group (vllm-ascend's
`update_attn_params` / `update_graph_params`, vllm_ascend/compilation/acl_graph.py).
Collectives (c10d ops such as `allreduce_`, HCCL's on the device) are recorded like aten ops
and waited for on replay. A host synchronisation while capturing (`.item()`) raises, as an
ACL capture does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

CALLS: Counter[str] = Counter()         # torch_npu op -> eager calls (captures included)
REPLAYS: Counter[str] = Counter()       # torch_npu op -> executions by graph replays
LAST: dict[str, dict[str, Any]] = {}    # torch_npu op -> its last execution's arguments


def _freeze(call: dict[str, Any], host: tuple[str, ...]) -> dict[str, Any]:
    """`call` with its host-side arguments copied (so later changes by the caller are not seen)."""
    frozen = dict(call)
    for name in host:
        value = frozen.get(name)
        if isinstance(value, torch.Tensor):
            frozen[name] = value.clone()
        elif isinstance(value, (list, tuple)):
            frozen[name] = list(value)
    return frozen


def _write_back(old: Any, new: Any) -> None:
    """Copy a replayed op's results into the tensors captured as its outputs."""
    olds, _ = tree_flatten(old)
    news, _ = tree_flatten(new)
    for n in news:   # a collective (c10d.allreduce_, captured as HCCL's is) returns a boxed Work: complete it
        if isinstance(n, torch.ScriptObject):
            torch.distributed.Work.unbox(n).wait()
    for o, n in zip(olds, news):
        if isinstance(o, torch.Tensor) and isinstance(n, torch.Tensor) and o is not n:
            if o.data_ptr() == n.data_ptr() and o.shape == n.shape and o.stride() == n.stride():
                continue   # a view of the same memory (views, in-place ops)
            o.copy_(n)


@dataclass
class Task:
    """One recorded step of a graph: an aten op or a torch_npu op, with its result."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    out: Any = None
    host: tuple[str, ...] | None = None   # None: an aten op; else a torch_npu op's host arguments

    def replay(self) -> None:
        if self.host is not None:
            REPLAYS[self.fn.__name__] += 1
            LAST[self.fn.__name__] = dict(self.kwargs)
        _write_back(self.out, self.fn(*self.args, **self.kwargs))


@dataclass
class TaskGroupHandle:
    """What `graph_task_group_end` returns: the torch_npu tasks captured in the group."""

    tasks: list[Task]


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list[Task]) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("ACL graph capture: a host synchronisation (.item()) is not allowed while "
                               "capturing (torch_npu double)")
        out = func(*args, **kwargs)
        self.tape.append(Task(func, args, kwargs, out))
        return out


class State:
    """The process's graph state: the graph being captured, the open task group, the task being updated."""

    def __init__(self) -> None:
        self.capturing: Any = None            # NPUGraph
        self.recorder: _Recorder | None = None
        self.group: list[Task] | None = None
        self.updating: list[Task] | None = None
        self.update_index = 0


STATE = State()


def run_op(fn: Callable[..., Any], call: dict[str, Any], host: tuple[str, ...]) -> Any:
    """Execute a torch_npu op (eagerly, under capture, or as a task update)."""
    st = STATE
    if st.updating is not None:
        if st.update_index >= len(st.updating) or st.updating[st.update_index].fn is not fn:
            raise RuntimeError(f"graph_task_update: {fn.__name__} is not the op captured in this task group")
        st.updating[st.update_index].kwargs = _freeze(call, host)
        st.update_index += 1
        return None
    if st.capturing is None:
        return fn(**call)
    task = Task(fn, (), _freeze(call, host), host=host)
    with _disable_current_modes():
        task.out = fn(**task.kwargs)
    st.capturing.tape.append(task)
    if st.group is not None:
        st.group.append(task)
    return task.out
