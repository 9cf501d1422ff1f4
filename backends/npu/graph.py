"""ACL graphs for the npu backend, as vllm-ascend captures decode (FULL_DECODE_ONLY) and as the
op-plugin documents task updates (docs/context/torch_npu-npu-graph_task_update_end.md).

The decode graph holds torch_npu's attention ops themselves (`_npu_paged_attention`; the fused
op's `.out` for a sliding-window layer). Their context lengths are read on the host and baked
into the captured task, so each op is captured, as vllm-ascend's update_attn_params expects
(vllm_ascend/compilation/acl_graph.py, attention/attention_v1.py):

- with a workspace sized once per graph for the largest context (the block table's width:
  `_npu_paged_attention_get_workspace` at that length, `_npu_fused_infer_attention_score_get_max_workspace`),
  passed at capture and at every update (an op sizing its own would size it for the capture's
  short warm-up lengths);
- writing into `out=` tensors the graph reads (an update re-binds the captured task; a functional
  op re-issued there would write fresh tensors the graph never reads);
- behind an `ExternalEvent` the graph waits on (`event.wait(stream)`, `event.reset(stream)`), inside
  a task group (`graph_task_group_begin/end`, which returns a handle).

Before every replay the tasks are re-bound to the step's context lengths on a separate update
stream: `graph_task_update_begin(update_stream, handle)`, the op's call with the same workspace
and outputs, `graph_task_update_end(update_stream)`, then `event.record(update_stream)`, which
releases the graph's wait. The op reads only the context's blocks, so one graph per batch size
covers every context length (`length_adaptive`). Prefill and mixed steps run eagerly (their
fused op takes host query lengths too); cudagraph_mode FULL falls back to FULL_DECODE_ONLY.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from polyrunner.backends.npu.device import npu_module
from polyrunner.plugin_api import (
    FULL,
    FULL_DECODE_ONLY,
    ModelInputs,
    StaticGraphExecutor,
    TorchGraphAPI,
    host_tensor,
)

PAGED_ATTENTION = "_npu_paged_attention"
FUSED_ATTENTION_OUT = "npu_fused_infer_attention_score.out"


def explain_capture_error(exc: BaseException) -> str:
    """ACL capture errors carry `retCode=...`; 0x7020023 means the device ran out of streams."""
    text = f"{type(exc).__name__}: {exc}"
    if "0x7020023" in text:
        text += " (insufficient streams: capture fewer sizes via runner.token_buckets)"
    return text


class ACLGraphAPI(TorchGraphAPI):
    def __init__(self) -> None:
        super().__init__(npu_module(), "NPUGraph", "acl graphs")

    def explain(self, exc: BaseException) -> str:
        return explain_capture_error(exc)


def attention_op(tnpu: Any, op_name: str) -> Callable[..., Any]:
    """torch_npu's op `op_name` (`.out` variants included)."""
    op: Callable[..., Any] = (tnpu.npu_fused_infer_attention_score.out if op_name == FUSED_ATTENTION_OUT
                              else getattr(tnpu, op_name))
    return op


def largest_workspace(tnpu: Any, op_name: str, kwargs: dict[str, Any]) -> torch.Tensor:
    """The op's workspace for the longest context its block table holds."""
    workspace: torch.Tensor
    if op_name == PAGED_ATTENTION:
        table = kwargs["block_table"]
        longest = np.full(table.shape[0], table.shape[1] * kwargs["key_cache"].shape[1], np.int32)
        workspace = tnpu._npu_paged_attention_get_workspace(
            **{**kwargs, "context_lens": host_tensor(torch.from_numpy(longest))})
    else:
        args = {k: v for k, v in kwargs.items() if k not in ("out", "workspace")}
        workspace = tnpu._npu_fused_infer_attention_score_get_max_workspace(**args)
    return workspace


@dataclass
class AttentionTask:
    """One captured attention op: its name, task-group handle, guarding event and arguments."""

    op_name: str
    handle: Any
    event: Any
    kwargs: dict[str, Any]


@dataclass
class DecodeCapture:
    """The decode graph being captured: its host context lengths, the attention tasks captured so
    far and their workspaces (one per op and shape: the layers share it, as in vllm-ascend)."""

    context_lens: torch.Tensor   # int32, host, [B]
    tasks: list[AttentionTask] = field(default_factory=list)
    workspaces: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)

    def workspace(self, tnpu: Any, op_name: str, kwargs: dict[str, Any]) -> torch.Tensor:
        key = (op_name,) + tuple(tuple(t.shape) for t in kwargs.values() if isinstance(t, torch.Tensor))
        if key not in self.workspaces:
            self.workspaces[key] = largest_workspace(tnpu, op_name, kwargs)
        return self.workspaces[key]


_capture: DecodeCapture | None = None


def capture_context_lens() -> torch.Tensor | None:
    """Host context lengths of the decode graph being captured (its warm-up runs included), or None."""
    return _capture.context_lens if _capture is not None else None


def host_context_lens(seq_lens: np.ndarray, rows: int) -> torch.Tensor:
    """int32 host tensor of `rows` context lengths; padded rows (length 0) read one (null) slot."""
    lens = np.ones(rows, np.int32)
    n = min(rows, len(seq_lens))
    lens[:n] = np.maximum(seq_lens[:n], 1)
    return host_tensor(torch.from_numpy(lens))


def launch(tnpu: Any, op_name: str, kwargs: dict[str, Any]) -> Any:
    """`torch_npu.<op_name>(**kwargs)` (a decode attention op whose lengths are host values, writing
    `out=`); while a decode graph is captured, as an updatable task (module docstring)."""
    op = attention_op(tnpu, op_name)
    npu = npu_module()
    if _capture is None or not npu.is_current_stream_capturing():
        return op(**kwargs)
    stream = npu.current_stream()
    kwargs = {**kwargs, "workspace": _capture.workspace(tnpu, op_name, kwargs)}
    event = npu.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    npu.graph_task_group_begin(stream)
    out = op(**kwargs)
    handle = npu.graph_task_group_end(stream)
    _capture.tasks.append(AttentionTask(op_name, handle, event, kwargs))
    return out


def with_context_lens(task: AttentionTask, lens: torch.Tensor) -> dict[str, Any]:
    """The task's arguments (its workspace and outputs) with a decode step's context lengths."""
    if task.op_name == PAGED_ATTENTION:
        return {**task.kwargs, "context_lens": lens}
    return {**task.kwargs, "actual_seq_lengths_kv": lens.tolist()}   # FUSED_ATTENTION_OUT (sliding window)


@dataclass
class ACLGraphExecutor(StaticGraphExecutor):
    """`StaticGraphExecutor` over ACL graphs whose decode attention is updated per replay (module doc)."""

    attention_tasks: dict[int, list[AttentionTask]] = field(default_factory=dict)   # by decode batch size
    update_stream: Any = None

    def __post_init__(self) -> None:
        asked = self.mode
        self.mode = FULL_DECODE_ONLY if asked == FULL else asked
        super().__post_init__()
        if asked == FULL and not self.enforce_eager:
            self.fallback_reason = ("cudagraph_mode FULL: the Ascend prefill op takes host sequence lengths; "
                                    "falling back to FULL_DECODE_ONLY (mixed and prefill steps run eagerly)")

    def _capture(self, inputs: ModelInputs, kind: str, T: int, R: int) -> torch.Tensor:
        global _capture
        _capture = DecodeCapture(host_context_lens(inputs.attn.seq_lens_np, R))
        try:
            out = super()._capture(inputs, kind, T, R)
            self.attention_tasks[T] = _capture.tasks
        finally:
            _capture = None
        return out

    def before_replay(self, kind: str, T: int, inputs: ModelInputs) -> None:
        """Re-bind every captured attention op of decode graph T to this step's context lengths, on
        the update stream, and release the graph's wait on each task's event."""
        tasks = self.attention_tasks.get(T, [])
        if not tasks:
            return
        tnpu = sys.modules["torch_npu"]
        lens = host_context_lens(inputs.attn.seq_lens_np, T)
        npu = npu_module()
        if self.update_stream is None:
            self.update_stream = npu.Stream()
        stream = self.update_stream
        npu.current_stream().synchronize()   # the last replay is done before its tasks change (acl_graph.py)
        with npu.stream(stream):
            for task in tasks:
                npu.graph_task_update_begin(stream, task.handle)
                attention_op(tnpu, task.op_name)(**with_context_lens(task, lens))
                npu.graph_task_update_end(stream)
                task.event.record(stream)
