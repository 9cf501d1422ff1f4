"""Ascend NPU backend plugin: ACL graphs, 2 MiB-aligned split K/V, HCCL.

torch_npu is never imported when this module is imported. `probe()` first
looks for it with `importlib.util.find_spec` ("torch_npu is not installed"),
then imports it inside a guard. With PyTorch's device-backend autoload
(`TORCH_DEVICE_BACKEND_AUTOLOAD`, on by default) an installed torch_npu is
already imported by `import torch`; with autoload off (=0) the probe imports
it. Either way a failing import or a missing device is reported as the
reason, never raised.

- Buckets and graphs: the CUDA plugin's capture sizes and static-buffer
  executor over `torch.npu.NPUGraph` (ACL graph mode, FULL_DECODE_ONLY: full-model
  decode graphs keyed by batch size; cudagraph_mode FULL falls back to it, as the
  attention is not length-adaptive; captured largest first in one pool; the static
  decode reads up to `max_seq_len_to_capture` tokens per request, longer
  contexts run eagerly). Inside graphs attention is the
  static SDPA decode (pure tensor ops); eager steps use torch_npu's
  `_npu_reshape_and_cache` + `_npu_paged_attention` for decodes when present.
- KV: one 2 MiB-aligned raw buffer per layer holding K then V, each half
  padded to 2 MiB (`kv_layout.py`). Caches stay in ND format: a private
  format (FRACTAL_NZ on 310P) could not share the logical 5-D view.
- Output copies run on a separate stream behind an event.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np
import torch

from polyrunner.backends.diagnose import Runtime, check_library
from polyrunner.backends.npu.kv_layout import ALIGNMENT, allocate_split_kv, split_kv_num_blocks
from polyrunner.plugin_api import (
    ATTENTION_FEATURES,
    FULL_DECODE_ONLY,
    STATIC_DECODE,
    AttentionMetadata,
    Availability,
    Backend,
    BucketPolicy,
    Capabilities,
    EngineConfig,
    GraphExecutor,
    HostFuture,
    KVCacheSpec,
    LayerSpec,
    StaticGraphExecutor,
    TorchGraphAPI,
    async_to_host,
    attend_cached,
    graph_bucket_policy,
    hookimpl,
    pinned_upload,
    profiled_kv_budget,
    requested_graph_mode,
    sdpa_paged_attention,
    worst_case_profile,
)

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
        if not hasattr(torch, "npu") or not torch.npu.is_available() or torch.npu.device_count() == 0:
            return None, "no NPU device", ""
    except Exception as exc:  # noqa: BLE001
        return None, f"NPU probe failed: {type(exc).__name__}: {exc}", ""
    return found.module, "", ""


def import_torch_npu() -> tuple[Any | None, str]:
    """(torch_npu, "") or (None, why not). Never raises; imports only if installed."""
    module, reason, _ = diagnose_torch_npu()
    return module, reason


def explain_capture_error(exc: BaseException) -> str:
    """ACL capture errors carry `retCode=...`; 0x7020023 means the device ran out of streams."""
    text = f"{type(exc).__name__}: {exc}"
    if "0x7020023" in text:
        text += " (insufficient streams: capture fewer sizes via runner.token_buckets)"
    return text


class ACLGraphAPI(TorchGraphAPI):
    def __init__(self) -> None:
        super().__init__(torch.npu, "NPUGraph", "acl graphs")

    def explain(self, exc: BaseException) -> str:
        return explain_capture_error(exc)


def npu_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
    """torch_npu kernels for the cache write and batched decode (eager steps);
    the SDPA path inside graphs, for sliding windows, or without torch_npu. (A soft-capped
    layer, which the backend declares unsupported, also takes the SDPA path: the cap is
    never ignored.)"""
    tnpu = sys.modules.get("torch_npu")
    if (tnpu is None or meta.extras.get(STATIC_DECODE) or spec.sliding_window is not None
            or spec.logits_soft_cap is not None
            or kv_cache.dtype != q.dtype or q.device.type != "npu"):
        return sdpa_paged_attention(q, k, v, kv_cache, meta, spec)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    tnpu._npu_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache,
                                meta.slot_mapping.to(torch.int32))

    def decode(q_dec: torch.Tensor, D: int) -> torch.Tensor:
        out = torch.empty_like(q_dec)
        tnpu._npu_paged_attention(
            query=q_dec.contiguous(), key_cache=key_cache, value_cache=value_cache,
            num_kv_heads=spec.num_kv_heads, num_heads=spec.num_heads, scale_value=spec.scale,
            block_table=meta.block_tables[:D].contiguous(),
            context_lens=torch.from_numpy(np.ascontiguousarray(meta.seq_lens_np[:D], np.int32)), out=out)
        return out

    return attend_cached(q, k, v, kv_cache, meta, spec, decode=decode)


class NPUBackend(Backend):
    """Huawei Ascend NPUs through torch_npu (torch.npu)."""

    name = "npu"
    priority = 90
    capabilities = Capabilities(graph_mode="acl_graph", static_shapes=False, counts_graphs=True,
                                async_scheduling=True, distributed_backend="hccl",
                                # torch_npu's _npu_paged_attention has no logit soft cap: Gemma 2 is refused
                                attention_features=ATTENTION_FEATURES - {"logits_soft_cap"})
    kv_alignment_bytes = ALIGNMENT
    executor: StaticGraphExecutor | None

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        module, reason = import_torch_npu()
        if module is None:
            raise RuntimeError(f"npu backend is unavailable: {reason}")
        self._device = torch.device("npu", torch.npu.current_device())
        self._copy_stream = None

    @classmethod
    def probe(cls) -> Availability:
        module, reason, fix = diagnose_torch_npu()
        if module is None:
            return Availability(False, reason, fix=fix)
        try:
            i = torch.npu.current_device()
            return Availability(True, "", f"npu:{i} ({torch.npu.get_device_name(i)}, "
                                          f"torch_npu {getattr(module, '__version__', '?')})")
        except Exception as exc:  # noqa: BLE001
            return Availability(False, f"NPU device query failed: {type(exc).__name__}: {exc}")

    @property
    def device(self) -> torch.device:
        return self._device

    @classmethod
    def device_count(cls) -> int:
        return torch.npu.device_count() if import_torch_npu()[0] is not None else 0

    def init_rank(self, local_rank: int, local_size: int) -> None:
        """Tensor-parallel rank `local_rank` runs on NPU `local_rank` of this host."""
        torch.npu.set_device(local_rank)
        self._device = torch.device("npu", local_rank)

    @property
    def default_dtype(self) -> torch.dtype:
        name = torch.npu.get_device_name(self._device.index or 0)
        return torch.float16 if "310P" in name else torch.bfloat16  # 310P has no bf16

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        """float16 and float32 everywhere; bfloat16 except on the 310P."""
        bf16 = (torch.bfloat16,) if self.default_dtype == torch.bfloat16 else ()
        return bf16 + (torch.float16, torch.float32)

    # ---- padding, KV, attention, graphs ------------------------------------
    def bucket_policy(self) -> BucketPolicy:
        return graph_bucket_policy(self.config)

    def kv_cache_budget(self, weights_bytes: int, profile) -> int:
        """The worst steps' peak plus the ACL graph pool's estimate stay free of KV (as on CUDA)."""
        ex, buckets = self.executor, self.bucket_policy()
        reserve = (lambda per_token: ex.pool_reserve_bytes(per_token, buckets)) if ex is not None else None
        return profiled_kv_budget(torch.npu, self.config, weights_bytes, worst_case_profile(profile), "npu",
                                  reserve)

    def num_kv_blocks(self, spec: KVCacheSpec, budget_bytes: int) -> int:
        return split_kv_num_blocks(spec, budget_bytes, self.kv_alignment_bytes)

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
        return allocate_split_kv(spec, num_blocks, self._device, self.kv_alignment_bytes)

    attention = staticmethod(npu_paged_attention)

    def make_executor(self, model: torch.nn.Module) -> GraphExecutor:
        config = self.config
        return StaticGraphExecutor(model, ACLGraphAPI(), max_num_seqs=config.scheduler.max_num_seqs,
                                   mode=requested_graph_mode(config, FULL_DECODE_ONLY))

    # ---- host <-> device ---------------------------------------------------
    def to_device(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        t = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        return pinned_upload(t, self._device)

    def to_host_async(self, tensor: torch.Tensor) -> HostFuture:
        if self._copy_stream is None:
            self._copy_stream = torch.npu.Stream(self._device)
        return async_to_host(torch.npu, tensor, self._copy_stream)

    def synchronize(self) -> None:
        torch.npu.synchronize()

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.npu.mem_get_info()
        return int(free), int(total)


PLUGIN_API_VERSION = "1.0"  # the plugin contract this plugin is written for (checked at registration)


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [NPUBackend]
