"""CUDA backend plugin: CUDA graphs, profiled KV budget, Triton paged attention.

Nothing here touches CUDA at import time: `probe()` asks
`torch.cuda.is_available()` and reports why not (a CPU-only PyTorch build,
no visible device) instead of failing.

- Graph mode (`runner.cudagraph_mode`, vLLM's names): FULL by default when the
  attention is Triton's (length-adaptive), else FULL_DECODE_ONLY; NONE (or
  `enforce_eager`) turns padding and graphs off. FULL asked for without Triton
  falls back to FULL_DECODE_ONLY with a warning.
- Buckets (`graph_bucket_policy`): vLLM's capture sizes (1, 2, 4, 8, 16, ...).
  Decode steps pad to the decode sizes (up to max_num_seqs, plus the one above);
  under FULL a mixed step pads its tokens to the next size up to
  min(max_num_batched_tokens, 512) and its requests to that graph's
  min(T, max_num_seqs); larger steps are not padded and run eagerly.
- Graphs (`StaticGraphExecutor`): one full-model CUDA graph per padded decode
  batch size and, under FULL, per mixed token count, captured largest first
  into one shared pool; replays (decode and mixed) and eager steps by reason
  are counted (`executor.counters()`); a failed capture is an error (run with
  enforce_eager=True or cudagraph_mode="NONE"). With Triton the attention
  reads the lengths on the device, so one graph serves every context length
  and every mix of prefills and decodes; without it the decode graphs read up
  to `max_seq_len_to_capture` (8192) tokens per request.
- KV budget: reset peak statistics, profile the worst steps (largest batch,
  longest prefill, sampler at max_num_seqs), reserve the estimated graph pool,
  then total * memory_utilization - (peak incl. weights + non-torch memory +
  reserve); or `cache.kv_cache_memory_bytes`.
- Attention: `triton_attention.triton_paged_attention` (one Triton kernel for
  mixed prefill + decode batches, plus a KV-write kernel) when triton is
  installed (the `cuda` extra); otherwise `sdpa_paged_attention` (torch SDPA /
  matmul) with a warning.
- Transfers: uploads staged through one persistent pinned arena per device
  (`pinned_upload` -> `PinnedStaging`; nothing pinned per step), non_blocking;
  outputs copied into a pinned buffer behind a CUDA event.
- Op overrides (`op_overrides.py`): fused Triton RMSNorm (with the residual
  add), rotary (in place) and SiLU-and-mul replace the core's modules when
  triton imports; `POLYRUNNER_CUDA_FUSED=0` keeps the core's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Callable

import numpy as np
import torch

from polyrunner.backends.cuda import envs
from polyrunner.backends.cuda.defaults import cuda_default_limits
from polyrunner.backends.cuda.op_overrides import cuda_op_overrides
from polyrunner.backends.diagnose import check_pinned, cuda_torch_fix, find_compiler
from polyrunner.plugin_api import (
    ATTENTION_FEATURES,
    FULL,
    FULL_DECODE_ONLY,
    AttentionMetadata,
    Availability,
    Backend,
    BucketPolicy,
    Capabilities,
    EngineConfig,
    GraphExecutor,
    HostFuture,
    LayerSpec,
    StaticGraphExecutor,
    TorchGraphAPI,
    UsageContext,
    async_to_host,
    graph_bucket_policy,
    hookimpl,
    pinned_upload,
    profiled_kv_budget,
    requested_graph_mode,
    resolve_graph_mode,
    sdpa_paged_attention,
    worst_case_profile,
)

logger = logging.getLogger(__name__)
AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, LayerSpec],
                       torch.Tensor]


def load_attention() -> tuple[AttentionOp, bool]:
    """(op, length_adaptive): the Triton op when triton imports, else the SDPA
    fallback with a warning saying why. Never raises."""
    if not envs.TRITON.get():
        logger.info("cuda: POLYRUNNER_CUDA_TRITON=0: SDPA paged attention")
        return sdpa_paged_attention, False
    if importlib.util.find_spec("triton") is None:
        logger.warning("cuda: triton is not installed (pip install 'polyrunner[cuda]'): falling back to SDPA "
                       "paged attention (slower decode; graphs read a fixed context width)")
        return sdpa_paged_attention, False
    try:
        from polyrunner.backends.cuda.triton_attention import triton_paged_attention
    except Exception as exc:  # noqa: BLE001 - a broken triton install is a fallback, not a crash
        logger.warning("cuda: triton failed to import (%s: %s): falling back to SDPA paged attention",
                       type(exc).__name__, exc)
        return sdpa_paged_attention, False
    return triton_paged_attention, True


def triton_note() -> tuple[str, str]:
    """("", "") when Triton attention will run, else (why not, the fix): triton missing,
    not the version torch pins, failing to import, or no C compiler to build its launcher."""
    if not envs.TRITON.get():
        return "", ""
    found = check_pinned("triton", "triton")
    if not found.ok:
        return f"{found.reason}: SDPA paged attention (slower decode)", found.fix
    if find_compiler() is None:
        return ("no C compiler on PATH (cc, gcc or clang): Triton cannot build its launcher",
                "install a C compiler (e.g. apt-get install gcc)")
    return "", ""


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
                                async_scheduling=True, distributed_backend="nccl", ray_device_key="GPU",
                                attention_features=ATTENTION_FEATURES)   # Triton's WINDOW/SOFTCAP; SDPA's fallback
    executor: StaticGraphExecutor | None

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._device = torch.device("cuda", torch.cuda.current_device())
        self.attention, self.length_adaptive = load_attention()

    @classmethod
    def probe(cls) -> Availability:
        reason = cuda_unavailable_reason()
        if reason is not None:   # a CPU-only torch build names the CUDA build's install command
            return Availability(False, reason, fix=cuda_torch_fix() if torch.version.cuda is None else "")
        try:
            i = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(i)
            device = f"cuda:{i} ({props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda})"
        except Exception as exc:  # noqa: BLE001
            return Availability(False, f"CUDA device query failed: {type(exc).__name__}: {exc}")
        note, fix = triton_note()
        return Availability(True, note, device, fix=fix)

    @property
    def device(self) -> torch.device:
        return self._device

    @classmethod
    def default_limits(cls, usage: UsageContext) -> dict[str, int]:
        return cuda_default_limits(usage)   # vLLM's, by the device's memory (backends/cuda/defaults.py)

    @classmethod
    def device_count(cls) -> int:
        return torch.cuda.device_count() if cuda_unavailable_reason() is None else 0

    def init_rank(self, local_rank: int, local_size: int) -> None:
        """Tensor-parallel rank `local_rank` runs on GPU `local_rank` of this host."""
        torch.cuda.set_device(local_rank)
        self._device = torch.device("cuda", local_rank)

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if cuda_native_bf16() else torch.float16

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        """float16 and float32 everywhere; bfloat16 from Ampere (sm_80) on."""
        return ((torch.bfloat16,) if cuda_native_bf16() else ()) + (torch.float16, torch.float32)

    # ---- padding, KV, attention, graphs ------------------------------------
    def bucket_policy(self) -> BucketPolicy:
        """Padding for the executor's graph mode (before it exists: the mode it will run)."""
        ex = self.executor
        mode = (ex.mode if isinstance(ex, StaticGraphExecutor)
                else resolve_graph_mode(self._requested_mode(), self.length_adaptive)[0])
        return graph_bucket_policy(self.config, mode=mode)

    def _requested_mode(self) -> str:
        """`runner.cudagraph_mode`, else FULL with a length-adaptive attention, else FULL_DECODE_ONLY."""
        return requested_graph_mode(self.config, FULL if self.length_adaptive else FULL_DECODE_ONLY)

    def kv_cache_budget(self, weights_bytes: int, profile) -> int:
        """The worst steps' peak plus the graph pool's estimate stay free of KV."""
        ex, buckets = self.executor, self.bucket_policy()
        reserve = (lambda per_token: ex.pool_reserve_bytes(per_token, buckets)) if ex is not None else None
        with torch.cuda.device(self._device):
            return profiled_kv_budget(torch.cuda, self.config, weights_bytes, worst_case_profile(profile), "cuda",
                                      reserve)

    def op_overrides(self, dtype: torch.dtype) -> dict[str, Callable[[torch.nn.Module], torch.nn.Module]]:
        """Fused Triton RMSNorm, rotary and SiLU-and-mul (`op_overrides.py`), or none without Triton."""
        return cuda_op_overrides(self.config, dtype)

    def make_executor(self, model: torch.nn.Module) -> GraphExecutor:
        config = self.config
        mode = self._requested_mode()
        return StaticGraphExecutor(
            model, TorchGraphAPI(torch.cuda, "CUDAGraph", "cuda graphs"), max_num_seqs=config.scheduler.max_num_seqs,
            mode=mode, length_adaptive=self.length_adaptive)

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


PLUGIN_API_VERSION = "1.0"  # the plugin contract this plugin is written for (checked at registration)


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [CUDABackend]
