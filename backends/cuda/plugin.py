"""CUDA backend plugin: CUDA graphs, profiled KV budget, SDPA paged attention.

Nothing here touches CUDA at import time: `probe()` asks
`torch.cuda.is_available()` and reports why not (a CPU-only PyTorch build,
no visible device) instead of failing.

- Buckets (`graphs.graph_bucket_policy`): capture sizes 1, 2, 4, 8, 16, 24, ...
  up to min(max_num_seqs, 512, max_num_batched_tokens) on both axes; larger
  batches are not padded and run eagerly. `runner.enforce_eager` turns padding
  and graphs off.
- Graphs (`graphs.StaticGraphExecutor`): full-model CUDA graphs of decode-only
  batches per (batch size, context width 512/2048/8192 tokens), captured largest
  first into one shared pool; prefill/mixed batches, batches above the largest
  graph and contexts above `max_seq_len_to_capture` (8192) run eagerly.
- KV budget: reset peak statistics, profile a max-size step, then
  total * memory_utilization - (torch peak incl. weights + non-torch memory);
  or `cache.kv_cache_memory_bytes`.
- Attention: `attention.sdpa_paged_attention` (torch SDPA/matmul, batched decode).
- Transfers: uploads staged through pinned memory (non_blocking); outputs
  copied into a pinned buffer behind a CUDA event.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from polyrunner.plugin_api import (
    Availability,
    Backend,
    BucketPolicy,
    Capabilities,
    GraphExecutor,
    HostFuture,
    StaticGraphExecutor,
    TorchGraphAPI,
    async_to_host,
    graph_bucket_policy,
    hookimpl,
    pinned_upload,
    profiled_kv_budget,
    sdpa_paged_attention,
)


def cuda_unavailable_reason() -> str | None:
    """None when a CUDA device is usable, else why not. Never raises."""
    try:
        if torch.version.cuda is None:
            return f"PyTorch {torch.__version__} was built without CUDA"
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return f"no CUDA device is visible{hint}"
    except Exception as exc:  # noqa: BLE001 - a broken driver is "unavailable", not a crash
        return f"CUDA probe failed: {type(exc).__name__}: {exc}"
    return None


def cuda_native_bf16() -> bool:
    """bfloat16 in hardware (compute capability 8.0+), not emulated."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.3: no emulation to exclude
        return torch.cuda.is_bf16_supported()


class CUDABackend(Backend):
    """NVIDIA GPUs through torch.cuda."""

    name = "cuda"
    priority = 100
    capabilities = Capabilities(graph_mode="cuda_graph", static_shapes=False, counts_graphs=True,
                                async_scheduling=True)

    def __init__(self) -> None:
        self._device = torch.device("cuda", torch.cuda.current_device())

    @classmethod
    def probe(cls) -> Availability:
        reason = cuda_unavailable_reason()
        if reason is not None:
            return Availability(False, reason)
        try:
            i = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(i)
            return Availability(True, "", f"cuda:{i} ({props.name}, {props.total_memory / 2**30:.0f} GiB, "
                                          f"CUDA {torch.version.cuda})")
        except Exception as exc:  # noqa: BLE001
            return Availability(False, f"CUDA device query failed: {type(exc).__name__}: {exc}")

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if cuda_native_bf16() else torch.float16

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        """float16 and float32 everywhere; bfloat16 from Ampere (sm_80) on."""
        return ((torch.bfloat16,) if cuda_native_bf16() else ()) + (torch.float16, torch.float32)

    # ---- padding, KV, attention, graphs ------------------------------------
    def bucket_policy(self, config) -> BucketPolicy:
        return graph_bucket_policy(config)

    def kv_cache_budget(self, config, weights_bytes: int, profile) -> int:
        with torch.cuda.device(self._device):
            return profiled_kv_budget(torch.cuda, config, weights_bytes, profile, "cuda")

    attention = staticmethod(sdpa_paged_attention)

    def make_executor(self, model: torch.nn.Module, config) -> GraphExecutor:
        return StaticGraphExecutor(model, TorchGraphAPI(torch.cuda, "CUDAGraph", "cuda graphs"),
                                   max_num_seqs=config.scheduler.max_num_seqs,
                                   enforce_eager=config.runner.enforce_eager)

    # ---- host <-> device ---------------------------------------------------
    def to_device(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        t = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        return pinned_upload(t, self._device)

    def to_host_async(self, tensor: torch.Tensor) -> HostFuture:
        return async_to_host(torch.cuda, tensor)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self._device)
        return int(free), int(total)


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [CUDABackend]
