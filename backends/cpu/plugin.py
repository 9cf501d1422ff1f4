"""CPU backend plugin."""

from __future__ import annotations

import functools
import os
import platform
import threading

import torch

from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.attention import cpu_paged_attention
from polyrunner.backends.cpu.executor import CPUExecutor
from polyrunner.backends.cpu.host_memory import advise_huge_pages, prefault_in_background
from polyrunner.backends.cpu.op_overrides import cpu_op_overrides
from polyrunner.backends.cpu.quant_linear import quantize_model
from polyrunner.backends.cpu.threads import physical_cpus, rank_cpus
from polyrunner.plugin_api import (
    ATTENTION_FEATURES,
    NULL_BLOCK,
    Availability,
    Backend,
    BucketPolicy,
    Capabilities,
    EngineConfig,
    graph_bucket_policy,
    hookimpl,
)

DEFAULT_KV_CAP = 4 << 30


def native_bf16() -> tuple[bool, str]:
    """Whether bfloat16 runs fast on this CPU, and the evidence. On x86 that takes AVX512_BF16
    or AMX (AMX-BF16), or AVX-512F with this build's AVX-512F bfloat16 linear (bf16 weights
    widened on the fly: `linear_avx512.cpp`, measured 2-4x oneDNN's emulated bfloat16 on an
    Ice Lake Xeon); without them (AVX2-only, or the kernels off) oneDNN and torch emulate
    bfloat16 with conversions, slower than float32. Elsewhere (Arm) oneDNN's own bfloat16
    check decides."""
    ok, why = _bf16_hardware()
    if ok or platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return ok, why
    if kernels.avx512_available():
        return True, "this CPU has AVX-512F (no AVX512_BF16 nor AMX): bfloat16 linears widen to float32 in " \
                     "polyrunner's AVX-512F kernel"
    return False, "this CPU has neither AVX512_BF16 nor AMX" + (
        "" if "avx512f" not in _proc_cpu_flags() else f" (AVX-512F bfloat16 linear off: "
        f"{kernels.avx512_unavailable_reason()})")


@functools.lru_cache(maxsize=None)
def _bf16_hardware() -> tuple[bool, str]:
    """(AVX512_BF16 or AMX on x86 / oneDNN's bfloat16 check elsewhere, the evidence)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686", "x86"):
        try:
            amx, avx512_bf16 = torch.cpu._is_amx_tile_supported(), torch.cpu._is_avx512_bf16_supported()
        except (AttributeError, RuntimeError):  # older torch: read the kernel's flags
            flags = _proc_cpu_flags()
            amx, avx512_bf16 = "amx_bf16" in flags, "avx512_bf16" in flags
        if amx or avx512_bf16:
            return True, f"this CPU has {'AMX' if amx else 'AVX512_BF16'}"
        return False, "this CPU has neither AVX512_BF16 nor AMX"
    try:
        ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        ok = False
    return ok, f"oneDNN {'supports' if ok else 'lacks'} bfloat16 on this {machine} CPU"


def _proc_cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


class CPUBackend(Backend):
    """Host memory; PyTorch with packed bf16 weights (small-M kernels for decode-sized
    steps) and fused elementwise kernels (its op overrides), C++ paged attention; CPU
    graphs of decode steps (`graphs.py`) padded to vLLM's capture sizes; always
    available."""

    name = "cpu"
    priority = 0
    capabilities = Capabilities(graph_mode="cpu_graph", counts_graphs=True, distributed_backend="gloo",
                                attention_features=ATTENTION_FEATURES)   # windows and soft caps in every path
    supported_quantization = ("gguf",)  # GGUF linears run quantized (quant_linear.py's QTYPES)
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._affinity: set[int] | None = None   # the process's CPUs before `init_rank`, for `leave_rank`
        self._kv_prefault: threading.Thread | None = None   # the KV cache's background prefault, if any

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, "", f"cpu ({torch.get_num_threads()} threads)")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def device_count(cls) -> int:
        """One "device" per physical core (a rank takes a share of them)."""
        return len(physical_cpus())

    def init_rank(self, local_rank: int, local_size: int) -> None:
        """A tensor-parallel rank runs on its own share of the physical cores (the
        thread count follows the affinity: `threads.default_threads`)."""
        share = rank_cpus(local_rank, local_size)
        if share:
            self._affinity = os.sched_getaffinity(0)
            os.sched_setaffinity(0, share)

    def leave_rank(self) -> None:
        if self._affinity:
            os.sched_setaffinity(0, self._affinity)
            self._affinity = None

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        """bfloat16 where the CPU has it (see `native_bf16`), and float32. float16
        is never native here: the fast paths (packed weights, fused kernels,
        paged attention) are bfloat16/float32 only."""
        return (torch.bfloat16, torch.float32) if native_bf16()[0] else (torch.float32,)

    def resolve_dtype(self, model_dtype):
        dtype, why = super().resolve_dtype(model_dtype)
        return dtype, f"{why}; {native_bf16()[1]}"

    def memory_info(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def kv_cache_budget(self, weights_bytes, profile) -> int:
        """`kv_cache_memory_bytes`, else 4 GiB capped at half the free host memory.
        No profile run: activations on the host are small next to free RAM."""
        config = self.config
        if config.cache.kv_cache_memory_bytes is not None:
            return config.cache.kv_cache_memory_bytes
        free, _ = self.memory_info()
        return int(min(DEFAULT_KV_CAP, free * config.cache.memory_utilization / 2))

    def allocate_kv_cache(self, spec, num_blocks):
        """Uninitialised host memory (every slot is written before it is read),
        except the null block, which padded requests may read; on transparent huge
        pages where the kernel allows. With `prefault_kv_cache` a background thread
        maps its pages (`host_memory`)."""
        caches = [torch.empty(spec.layer_shape(num_blocks), dtype=spec.dtype) for _ in range(spec.num_layers)]
        for cache in caches:
            advise_huge_pages(cache)
            cache[:, NULL_BLOCK].zero_()
        if self.config.cache.prefault_kv_cache:
            self._kv_prefault = prefault_in_background(caches, parts=2)   # K and V halves, in block order
        return caches

    def wait_kv_cache_mapped(self, timeout=None):
        """Joins the background prefault of the last cache allocated (if any)."""
        thread = self._kv_prefault
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def to_device(self, array):
        return torch.from_numpy(array) if not isinstance(array, torch.Tensor) else array

    def op_overrides(self, dtype):
        """bfloat16: packed linears and fused RMSNorm, rotary and MLP (`op_overrides.py`); else none."""
        return cpu_op_overrides(self.config, dtype)

    def make_executor(self, model):
        return CPUExecutor(model, self.config)

    def bucket_policy(self) -> BucketPolicy:
        """vLLM's decode capture sizes up to the largest batch the executor's CPU graphs
        take (`CPUExecutor.graph_rows`); none without a CPUExecutor (a subclass may make
        another) or without graphs."""
        rows = self.executor.graph_rows if isinstance(self.executor, CPUExecutor) else 0
        return graph_bucket_policy(self.config, rows) if rows else BucketPolicy()

    attention = staticmethod(cpu_paged_attention)
    quantize_model = staticmethod(quantize_model)


PLUGIN_API_VERSION = "1.0"  # the plugin contract this plugin is written for (checked at registration)


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [CPUBackend]
