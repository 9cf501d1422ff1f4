"""Ascend NPU backend plugin: ACL graphs, 2 MiB-aligned split K/V, torch_npu's fused ops, HCCL.

torch_npu is never imported when this module is imported. `probe()` first
looks for it with `importlib.util.find_spec` ("torch_npu is not installed"),
then imports it inside a guard. With PyTorch's device-backend autoload
(`TORCH_DEVICE_BACKEND_AUTOLOAD`, on by default) an installed torch_npu is
already imported by `import torch`; with autoload off (=0) the probe imports
it. Either way a failing import or a missing device is reported as the
reason, never raised.

- Attention (`attention.py`), as vllm-ascend: `_npu_reshape_and_cache`, `_npu_paged_attention`
  for decode steps, one `npu_fused_infer_attention_score` call per step with prefill tokens (TND,
  sparse_mode 3; a sliding window: BSND, sparse_mode 4); per-step int32/host tensors built once per step.
- Graphs (`graph.py`): FULL_DECODE_ONLY decode graphs over `npu_module().NPUGraph` that hold the
  paged-attention op itself, captured with a workspace for the largest context, writing `out=`,
  behind an ExternalEvent; its host context lengths are updated before each replay on an update
  stream (task-group update); one graph per batch size covers every context length.
- Op overrides (`fused_modules.py`): `npu_rms_norm` / `npu_add_rms_norm`, `npu_rotary_mul`, `npu_swiglu`.
- What the ops take (`limits.py`), refused at start-up with the field, the rule and the value:
  float16/bfloat16 (`check_dtype`; dtype "auto" on a float32 checkpoint runs the device's default),
  block sizes 128 to 512 in steps of 128 (`adjust_config`; 128 unless the configuration sets one),
  head sizes a multiple of 16 up to 256 (with the KV cache's spec).
- KV: one 2 MiB-aligned raw buffer per layer holding K then V, each half
  padded to 2 MiB (`kv_layout.py`). Caches stay in ND format: a private
  format (FRACTAL_NZ on 310P) could not share the logical 5-D view.
- Output copies run on a separate stream behind an event.
- Device: `device.py` (`npu_device`; the seam a torch_npu test double uses to run on the host).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from polyrunner.backends.diagnose import Runtime, check_library
from polyrunner.backends.npu.attention import npu_paged_attention
from polyrunner.backends.npu.device import is_emulated, npu_device, npu_module
from polyrunner.backends.npu.fused_modules import npu_op_overrides
from polyrunner.backends.npu.graph import ACLGraphAPI, ACLGraphExecutor, explain_capture_error
from polyrunner.backends.npu.kv_layout import ALIGNMENT, allocate_split_kv, split_kv_num_blocks
from polyrunner.backends.npu.limits import DTYPES, check_block_size, check_dtype, check_kv_spec
from polyrunner.plugin_api import (
    ATTENTION_FEATURES,
    FULL_DECODE_ONLY,
    Availability,
    Backend,
    BucketPolicy,
    Capabilities,
    EngineConfig,
    GraphExecutor,
    HostFuture,
    KVCacheSpec,
    async_to_host,
    graph_bucket_policy,
    hookimpl,
    pinned_upload,
    profiled_kv_budget,
    requested_graph_mode,
    worst_case_profile,
)

__all__ = ["NPUBackend", "diagnose_torch_npu", "explain_capture_error", "import_torch_npu", "npu_paged_attention"]
logger = logging.getLogger(__name__)


# torch_npu loads CANN's libraries (libascendcl, libhccl, libge_runner, ...) at import
CANN = Runtime("CANN", r"ascend|libhccl|libacl|libge_|libgraph|libopapi|libruntime|libtsdclient|\bcann\b",
               "install the CANN toolkit, then: source /usr/local/Ascend/ascend-toolkit/set_env.sh")


def diagnose_torch_npu() -> tuple[Any | None, str, str]:
    """(torch_npu, "", "") or (None, why not, the command that fixes it). Never raises;
    imports torch_npu only when it is installed for the installed torch."""
    found = check_library("torch_npu", "torch_npu", CANN)  # autoloaded module, wrong torch, CANN, ...
    if not found.ok:
        return None, found.reason, found.fix
    try:
        if not hasattr(torch, "npu") or not npu_module().is_available() or npu_module().device_count() == 0:
            return None, "no NPU device", ""
    except Exception as exc:  # noqa: BLE001
        return None, f"NPU probe failed: {type(exc).__name__}: {exc}", ""
    return found.module, "", ""


def import_torch_npu() -> tuple[Any | None, str]:
    """(torch_npu, "") or (None, why not). Never raises; imports only if installed."""
    module, reason, _ = diagnose_torch_npu()
    return module, reason


class NPUBackend(Backend):
    """Huawei Ascend NPUs through torch_npu (torch.npu)."""

    name = "npu"
    priority = 90
    capabilities = Capabilities(graph_mode="acl_graph", static_shapes=False, counts_graphs=True, dtypes=DTYPES,
                                async_scheduling=True, distributed_backend="hccl", ray_device_key="NPU",
                                # torch_npu's _npu_paged_attention has no logit soft cap: Gemma 2 is refused
                                attention_features=ATTENTION_FEATURES - {"logits_soft_cap"})
    kv_alignment_bytes = ALIGNMENT
    default_block_size = 128   # vllm-ascend's block size (the ATB paged-attention kernels' tile)
    executor: ACLGraphExecutor | None

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        module, reason = import_torch_npu()
        if module is None:
            raise RuntimeError(f"npu backend is unavailable: {reason}")
        self._device = npu_device(npu_module().current_device())
        self._copy_stream = None

    @classmethod
    def adjust_config(cls, config: EngineConfig) -> None:
        """Block size 128 where the configuration leaves it unset; ValueError for a block size the
        paged-attention ops refuse (`limits.py`)."""
        if "block_size" not in config.cache.model_fields_set:
            config.cache.block_size = cls.default_block_size
        check_block_size(config.cache.block_size)

    @classmethod
    def probe(cls) -> Availability:
        module, reason, fix = diagnose_torch_npu()
        if module is None:
            return Availability(False, reason, fix=fix)
        try:
            i = npu_module().current_device()
            return Availability(True, "", f"npu:{i} ({npu_module().get_device_name(i)}, "
                                          f"torch_npu {getattr(module, '__version__', '?')})")
        except Exception as exc:  # noqa: BLE001
            return Availability(False, f"NPU device query failed: {type(exc).__name__}: {exc}")

    @property
    def device(self) -> torch.device:
        return self._device

    @classmethod
    def device_count(cls) -> int:
        return npu_module().device_count() if import_torch_npu()[0] is not None else 0

    def init_rank(self, local_rank: int, local_size: int) -> None:
        """Tensor-parallel rank `local_rank` runs on NPU `local_rank` of this host."""
        npu_module().set_device(local_rank)
        self._device = npu_device(local_rank)

    @property
    def default_dtype(self) -> torch.dtype:
        name = npu_module().get_device_name(self._device.index or 0)
        return torch.float16 if "310P" in name else torch.bfloat16  # 310P has no bf16

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        """What the attention ops take: float16 everywhere, bfloat16 except on the 310P."""
        bf16 = (torch.bfloat16,) if self.default_dtype == torch.bfloat16 else ()
        return bf16 + (torch.float16,)

    def check_dtype(self, dtype: torch.dtype) -> None:
        """ValueError naming the allowed dtypes for one the attention ops refuse (float32)."""
        check_dtype(dtype, self.native_dtypes())

    def resolve_dtype(self, model_dtype: torch.dtype | None) -> tuple[torch.dtype, str]:
        """dtype "auto": the checkpoint's dtype where the ops take it, else the device's default."""
        if model_dtype is not None and model_dtype in self.native_dtypes():
            return model_dtype, f"the model's torch_dtype, native on backend {self.name!r}"
        named = "no torch_dtype" if model_dtype is None else str(model_dtype).removeprefix("torch.")
        return self.default_dtype, (f"the model names {named}; backend {self.name!r} runs float16 and bfloat16 "
                                    f"only: its default, {str(self.default_dtype).removeprefix('torch.')}")

    # ---- padding, KV, attention, graphs ------------------------------------
    def bucket_policy(self) -> BucketPolicy:
        return graph_bucket_policy(self.config)

    def kv_cache_budget(self, weights_bytes: int, profile: Callable[[], None]) -> int:
        """The worst steps' peak plus the ACL graph pool's estimate stay free of KV (as on CUDA)."""
        ex, buckets = self.executor, self.bucket_policy()
        reserve = (lambda per_token: ex.pool_reserve_bytes(per_token, buckets)) if ex is not None else None
        return profiled_kv_budget(npu_module(), self.config, weights_bytes, worst_case_profile(profile), "npu",
                                  reserve)

    def num_kv_blocks(self, spec: KVCacheSpec, budget_bytes: int) -> int:
        return split_kv_num_blocks(spec, budget_bytes, self.kv_alignment_bytes)

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
        """Split K/V (`kv_layout.py`); ValueError for a dtype, block size or head size the ops refuse."""
        check_kv_spec(spec)
        return allocate_split_kv(spec, num_blocks, self._device, self.kv_alignment_bytes)

    attention = staticmethod(npu_paged_attention)

    def op_overrides(self, dtype: torch.dtype) -> dict[str, Callable[[torch.nn.Module], torch.nn.Module]]:
        """torch_npu's fused RMSNorm (+ residual), rotary and SwiGLU (`fused_modules.py`)."""
        return npu_op_overrides(dtype)

    def make_executor(self, model: torch.nn.Module) -> GraphExecutor:
        """Decode graphs holding the paged-attention op, updated per replay (`graph.py`)."""
        config = self.config
        return ACLGraphExecutor(model, ACLGraphAPI(), max_num_seqs=config.scheduler.max_num_seqs,
                                length_adaptive=True, mode=requested_graph_mode(config, FULL_DECODE_ONLY))

    # ---- host <-> device ---------------------------------------------------
    def to_device(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        t = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        if is_emulated(self._device):   # a test double's host device: no pinned memory there
            return t.to(self._device, copy=True)
        return pinned_upload(t, self._device)

    def to_host_async(self, tensor: torch.Tensor) -> HostFuture:
        if is_emulated(self._device):
            return HostFuture(tensor.to("cpu", copy=True))
        if self._copy_stream is None:
            self._copy_stream = npu_module().Stream(self._device)
        return async_to_host(npu_module(), tensor, self._copy_stream)

    def synchronize(self) -> None:
        npu_module().synchronize()

    def memory_info(self) -> tuple[int, int]:
        free, total = npu_module().mem_get_info()
        return int(free), int(total)


PLUGIN_API_VERSION = "1.0"  # the plugin contract this plugin is written for (checked at registration)


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [NPUBackend]
