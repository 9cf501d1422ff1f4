"""ACL graphs for the npu backend, as vllm-ascend captures decode (FULL_DECODE_ONLY).

The decode graph holds torch_npu's paged-attention op itself (`npu_fused_infer_attention_score`
for a sliding-window layer). Its context lengths are read on the host and baked into the
captured task, so each attention op is captured inside a task group
(`torch.npu.graph_task_group_begin/end`, which returns a handle) and, before every replay,
re-bound to the step's context lengths with `graph_task_update_begin(stream, handle)`, the
op's call, `graph_task_update_end(stream)`: vllm-ascend's `update_attn_params`
(vllm_ascend/compilation/acl_graph.py). The op reads only the context's blocks, so one graph
per batch size covers every context length (`length_adaptive`): no fixed-width gather.
Prefill and mixed steps run eagerly (their fused op takes host query lengths too);
cudagraph_mode FULL falls back to FULL_DECODE_ONLY.
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
FUSED_ATTENTION = "npu_fused_infer_attention_score"


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


@dataclass
class AttentionTask:
    """One captured attention op: its name, task-group handle and the arguments it was captured with."""

    op_name: str
    handle: Any
    kwargs: dict[str, Any]


@dataclass
class DecodeCapture:
    """The decode graph being captured: its host context lengths and the attention tasks captured so far."""

    context_lens: torch.Tensor   # int32, host, [B]
    tasks: list[AttentionTask] = field(default_factory=list)


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
    """`torch_npu.<op_name>(**kwargs)` (an attention op whose lengths are host values); while a
    decode graph is captured, inside a task group whose handle is kept for the per-replay update."""
    op: Callable[..., Any] = getattr(tnpu, op_name)
    npu = npu_module()
    if _capture is None or not npu.is_current_stream_capturing():
        return op(**kwargs)
    stream = npu.current_stream()
    npu.graph_task_group_begin(stream)
    out = op(**kwargs)
    handle = npu.graph_task_group_end(stream)
    _capture.tasks.append(AttentionTask(op_name, handle, kwargs))
    return out


def with_context_lens(task: AttentionTask, lens: torch.Tensor) -> dict[str, Any]:
    """The task's arguments with a decode step's context lengths (host int32 `[B]`)."""
    if task.op_name == PAGED_ATTENTION:
        return {**task.kwargs, "context_lens": lens}
    return {**task.kwargs, "actual_seq_lengths_kv": lens.tolist()}   # FUSED_ATTENTION (sliding window)


@dataclass
class ACLGraphExecutor(StaticGraphExecutor):
    """`StaticGraphExecutor` over ACL graphs whose decode attention is updated per replay (module doc)."""

    attention_tasks: dict[int, list[AttentionTask]] = field(default_factory=dict)   # by decode batch size

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
        """Re-bind every captured attention op of decode graph T to this step's context lengths."""
        tasks = self.attention_tasks.get(T, [])
        if not tasks:
            return
        tnpu = sys.modules["torch_npu"]
        lens = host_context_lens(inputs.attn.seq_lens_np, T)
        npu = npu_module()
        stream = npu.current_stream()
        for task in tasks:
            npu.graph_task_update_begin(stream, task.handle)
            getattr(tnpu, task.op_name)(**with_context_lens(task, lens))
            npu.graph_task_update_end(stream)
