"""XLA backend (TPU path, verified on CPU XLA): padding buckets, precompiled
graphs, a no-recompilation guarantee, static-shape attention and sampling.

torch_xla is imported only inside `probe()` and methods, never at module
import: without it the backend is listed as "unavailable: torch_xla is not
installed". `PJRT_DEVICE` picks the device (CPU in CI, TPU in production).

What runs where:
- inputs are prepared on the host (numpy), padded to a (token, request)
  bucket and moved with plain transfers, which never compile;
- the KV cache is allocated on the host and transferred (no fill op compiled);
- attention is `polyrunner.attention.static_shape` (plain torch, one graph per
  token bucket and context bucket, see `static_attention.py`). On a real TPU
  with `POLYRUNNER_XLA_PALLAS` not "0", the Pallas ragged paged attention
  kernel is used instead, through its registered op (see `pallas.py`), every
  head size padded to a multiple of 128 (`head_pad.py`;
  `POLYRUNNER_XLA_PAD_HEAD=1` pads on the CPU device too): that path is
  UNVERIFIED on TPU hardware, and is isolated behind the probe;
- either way, under dynamo (the default) each layer's KV cache is donated to
  the compiled step and updated in place, never copied whole (`kv_update.py`);
- the KV budget comes from a profile run's peak on a TPU (`memory.py`), and
  the block size defaults to vLLM's TPU page size there;
- graphs and sampling: see `executor.py` and `sampling.py`.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from polyrunner.backends.diagnose import Runtime, check_library, installed_version
from polyrunner.backends.supported_versions import STACKS
from polyrunner.backends.xla import compile_cache, envs, head_pad, kv_update, static_attention
from polyrunner.backends.xla.buckets import xla_bucket_policy
from polyrunner.backends.xla.memory import profiled_kv_budget, tpu_page_size
from polyrunner.plugin_api import (
    ATTENTION_FEATURES,
    AttentionMetadata,
    Availability,
    Backend,
    BucketPolicy,
    Capabilities,
    GraphExecutor,
    HostFuture,
    KVCacheSpec,
    LayerSpec,
    hookimpl,
    resolved_max_model_len,
    static_shape_paged_attention,
)

if TYPE_CHECKING:
    from polyrunner.plugin_api import EngineConfig, StepInputs

logger = logging.getLogger(__name__)

XLA_SAMPLING = frozenset({"temperature", "top_k", "top_p", "min_p", "seed", "logprobs"})


# torch_xla loads libtpu at import only on a TPU VM; a libtpu that fails to load names itself
LIBTPU = Runtime("TPU (libtpu)", r"libtpu", STACKS["tpu"].install)


def _device_kind() -> str:
    import torch_xla.runtime as xr
    return str(xr.device_type() or "")


def _device_count() -> int:
    """Starts the runtime client without making the default device: `torch_xla.device()` before
    `xr.use_spmd()` leaves SPMD broken (a segfault at the first sharded sync, torch_xla 2.9)."""
    import torch_xla.runtime as xr
    return int(xr.global_runtime_device_count())


class XLABackend(Backend):
    """torch_xla device: TPU in production, the CPU PJRT device in CI.

    Tensor parallelism is SPMD sharding of one program in one process
    (`Capabilities.spmd`, `spmd.py`), not one process per device as the
    engine's ranks are."""

    name = "xla"
    priority = 20
    capabilities = Capabilities(graph_mode="xla", static_shapes=True, counts_graphs=True,
                                dtypes=(torch.float32, torch.bfloat16), sampling=XLA_SAMPLING,
                                attention_features=ATTENTION_FEATURES,   # static-shape torch and Pallas both
                                spmd=True)

    def __init__(self, config: "EngineConfig") -> None:
        super().__init__(config)
        self._device: torch.device | None = None
        self.tp_size = config.parallel.tensor_parallel_size
        if self.tp_size > 1:
            from polyrunner.backends.xla import spmd
            spmd.enable(self.tp_size)   # before the runtime client starts
        self.compile_cache = compile_cache.enable(self.on_tpu())   # before this process compiles
        self._pallas: bool | None = None   # Pallas attention (None: not decided yet)
        self._context_width: int | None = None   # forced context bucket while precompiling

    # ---- identity -------------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        # Read before importing: torch_xla's import fills in PJRT_DEVICE=CPU by default.
        explicit = os.environ.get("PJRT_DEVICE")
        found = check_library("torch_xla", "torch_xla", LIBTPU)  # not installed / wrong torch / broken
        if not found.ok:
            return Availability(False, found.reason, fix=found.fix)
        libtpu = installed_version("libtpu") or installed_version("libtpu-nightly")
        tpu_fix = "" if libtpu else STACKS["tpu"].install
        try:
            kind = _device_kind()
            if not explicit and kind != "TPU":
                runtime = f"libtpu {libtpu} is installed" if libtpu else "libtpu is not installed"
                return Availability(False, f"no TPU found ({runtime}; set PJRT_DEVICE=CPU to run on the CPU "
                                           "XLA device)", fix="export PJRT_DEVICE=CPU (the CPU XLA device)"
                                    + (f", or on a TPU VM: {tpu_fix}" if tpu_fix else ""))
            count = _device_count()
        except Exception as exc:
            why = f"no XLA device: {type(exc).__name__}: {exc}"
            return Availability(False, why + ("" if libtpu else " (libtpu is not installed)"), fix=tpu_fix)
        return Availability(True, "", ("xla:0" if count == 1 else f"xla:0..{count - 1}") + f" ({kind})")

    @property
    def device(self) -> torch.device:
        if self._device is None:
            import torch_xla
            self._device = torch_xla.device()
        return self._device

    @classmethod
    def on_tpu(cls) -> bool:
        return _device_kind() == "TPU"

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.on_tpu() else torch.float32

    @classmethod
    def wants_pallas(cls) -> bool:
        """Pallas ragged paged attention: real TPU only (unverified on hardware)."""
        return cls.on_tpu() and envs.PALLAS.get()

    @property
    def use_pallas(self) -> bool:
        if self._pallas is None:
            self._pallas = self.wants_pallas()
            if self._pallas:
                from polyrunner.backends.xla import pallas
                pallas.define_ops()   # before a step is traced
        return self._pallas

    def pads_head(self, head_size: int) -> bool:
        """Pad the head size to a multiple of 128: always for Pallas, on request elsewhere."""
        return head_size % head_pad.TPU_HEAD_SIZE_ALIGNMENT != 0 and (self.use_pallas or envs.PAD_HEAD.get())

    # ---- padding --------------------------------------------------------------
    @classmethod
    def policy_for(cls, config: "EngineConfig") -> BucketPolicy:
        """The buckets of `config`: `xla_bucket_policy`, its requests capped by Pallas's limit."""
        limit = None
        if cls.wants_pallas() and "block_size" not in config.cache.model_fields_set:
            config.cache.block_size = tpu_page_size(resolved_max_model_len(config))   # vLLM's TPU default
        if cls.wants_pallas():
            from polyrunner.backends.xla import pallas
            limit = pallas.max_num_seqs(resolved_max_model_len(config), config.cache.block_size)
        return xla_bucket_policy(config, limit)

    @classmethod
    def adjust_config(cls, config: "EngineConfig") -> None:
        """Compiled shapes end at the largest request bucket (which a kernel's request
        limit may hold below max_num_seqs): cap max_num_seqs there, so every step
        fits one bucket."""
        largest = cls.policy_for(config).request_buckets[-1]
        sched = config.scheduler
        if sched.max_num_seqs > largest:
            logger.info("xla: max_num_seqs %d -> %d, the largest request bucket", sched.max_num_seqs, largest)
            sched.max_num_seqs = largest

    def bucket_policy(self) -> BucketPolicy:
        return self.policy_for(self.config)

    @functools.cached_property
    def max_request_bucket(self) -> int:
        """The largest request bucket of this engine (Pallas's per-step request table)."""
        return self.bucket_policy().request_buckets[-1]

    # ---- KV cache ---------------------------------------------------------------
    def kv_cache_budget(self, weights_bytes: int, profile: Callable[[], None]) -> int:
        """On a TPU: limit x utilisation - the peak of a profile run of the largest bucket
        (`memory.profiled_kv_budget`, vLLM's TPU profile run). The CPU PJRT device has no
        memory info: there the budget is free host memory x utilisation - weights, capped at
        1 GiB (`POLYRUNNER_XLA_CPU_KV_BYTES`). kv_cache_memory_bytes wins on both."""
        config = self.config
        if config.cache.kv_cache_memory_bytes is not None:
            return config.cache.kv_cache_memory_bytes
        if self.on_tpu():
            import torch_xla.core.xla_model as xm
            return profiled_kv_budget(lambda: dict(xm.get_memory_info(self.device)), profile, self.synchronize,
                                      config.cache.memory_utilization)
        free, _ = self.memory_info()
        cap = envs.CPU_KV_BYTES.get()
        return max(0, min(cap, int(free * config.cache.memory_utilization) - weights_bytes))

    def device_kv_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """The cache as allocated: at the padded head size when `pads_head`."""
        return head_pad.padded_spec(spec) if self.pads_head(spec.head_size) else spec

    def num_kv_blocks(self, spec: KVCacheSpec, budget_bytes: int) -> int:
        return super().num_kv_blocks(self.device_kv_spec(spec), budget_bytes)

    @functools.cached_property
    def context_buckets(self) -> list[int]:
        """Block-table widths of the static-shape attention (none for Pallas, which reads kv_lens)."""
        if self.use_pallas:
            return []
        return static_attention.context_buckets(resolved_max_model_len(self.config), self.config.cache.block_size,
                                                envs.MIN_CONTEXT.get())

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
        """Zeros made on the host and transferred: a transfer never compiles a graph. Refuses
        the static-shape attention on a real device when its gather would not fit."""
        spec = self.device_kv_spec(spec)
        if self.use_pallas:
            from polyrunner.backends.xla import pallas
            shape: tuple[int, ...] = pallas.kv_cache_shape(spec, num_blocks)
        else:
            if self.on_tpu():
                tokens = self.bucket_policy().token_buckets[-1]
                static_attention.check_gather_fits(tokens, self.context_buckets[-1] * spec.block_size,
                                                   spec.num_kv_heads, spec.head_size,
                                                   envs.STATIC_GATHER_BYTES.get())
            shape = spec.layer_shape(num_blocks)
        caches = [torch.zeros(shape, dtype=spec.dtype).to(self.device) for _ in range(spec.num_layers)]
        if self.tp_size > 1:
            from polyrunner.backends.xla import spmd
            for cache in caches:   # the KV-head dimension: 2 * Hkv interleaved for Pallas, Hkv otherwise
                spmd.shard_kv_cache(cache, 2 if self.use_pallas else 3, self.tp_size)
        return caches

    # ---- attention ----------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        size, head = kv_cache.shape[-1], q.shape[-1]
        if size != head:   # the padded head layout (`head_pad`); the scale stays the real head size's
            q, k, v = (head_pad.pad_heads(t, size) for t in (q, k, v))
        if "pallas_num_seqs" in meta.extras:
            from polyrunner.backends.xla import pallas
            out = pallas.attention(q, k, v, kv_cache, meta, spec)   # donates the cache (`kv_update`)
        else:
            kv_update.donate(kv_cache)   # updated in place, not copied, by the compiled step
            out = static_shape_paged_attention(q, k, v, kv_cache, meta, spec)
        return out if size == head else out[..., :head]

    def host_attention_extras(self, step: "StepInputs") -> dict[str, np.ndarray]:
        """Host-built, token-shaped inputs so the backbone graph depends only on T_pad."""
        if self.use_pallas:
            from polyrunner.backends.xla import pallas
            return pallas.host_inputs(step, self.max_request_bucket)
        return static_attention.token_tables(step, self.config.cache.block_size, self.context_buckets,
                                             self._context_width)

    def force_context_width(self, width: int | None) -> None:
        """Precompilation: build every step's token block table `width` blocks wide (None: by its context)."""
        self._context_width = width

    # ---- graphs -------------------------------------------------------------------
    def no_grad(self):
        """torch_xla's functionalization cannot take inference tensors."""
        from polyrunner.backends.xla.executor import no_grad_not_inference
        return no_grad_not_inference()

    def make_executor(self, model: torch.nn.Module) -> GraphExecutor:
        from polyrunner.backends.xla.executor import XLAGraphExecutor, strict_from_env
        config = self.config
        if self.tp_size > 1:
            from polyrunner.backends.xla import spmd
            logger.info("xla: %d weights sharded over %d devices", spmd.shard_model(model, self.tp_size),
                        self.tp_size)
        return XLAGraphExecutor(model, self.device,
                                strict=config.runner.strict_no_recompile or strict_from_env(),
                                enforce_eager=config.runner.enforce_eager, seed=config.model.seed,
                                context_widths=self.context_buckets, set_context=self.force_context_width)

    # ---- host <-> device ------------------------------------------------------------
    def to_device(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        t = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        return t.to(self.device)

    def to_host_async(self, tensor: torch.Tensor) -> HostFuture:
        return HostFuture(tensor.cpu())  # blocking: torch_xla has no async device->host copy here

    def synchronize(self) -> None:
        import torch_xla.core.xla_model as xm
        xm.wait_device_ops()

    def make_generator(self, seed: int) -> torch.Generator:
        # Sampling noise is counter-based (seed, output index) on the device; the
        # generator only satisfies the runner's per-request bookkeeping.
        g = torch.Generator()
        g.manual_seed(seed)
        return g

    @property
    def memory_is_host(self) -> bool:
        return not self.on_tpu()

    def memory_info(self) -> tuple[int, int]:
        if self.on_tpu():
            import torch_xla.core.xla_model as xm
            info = xm.get_memory_info(self.device)
            total = int(info["bytes_limit"])
            return total - int(info["bytes_used"]), total
        page = os.sysconf("SC_PAGE_SIZE")  # the CPU PJRT device lives in host memory
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


PLUGIN_API_VERSION = "1.0"  # the plugin contract this plugin is written for (checked at registration)


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [XLABackend]

