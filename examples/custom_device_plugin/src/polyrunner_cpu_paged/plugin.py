"""The `cpu_paged` backend: what a device plugin is, in one file.

A polyrunner plugin is a module with `@hookimpl` functions. This one
contributes one `Backend` subclass; the core does everything else (requests,
scheduling, batching, sampling, outputs). What it overrides:

- identity: `name`, `priority`, `probe()`, `device`, `capabilities`;
- padding: powers of two for tokens, every count 1..max_num_seqs for requests;
- KV cache: a heads-major layout (`kv_layout.py`), 64-byte aligned, budgeted
  like the built-in CPU backend;
- attention: `kv_layout.paged_attention`, reading that layout directly;
- graphs: none (no torch.compile): `PaddedEagerExecutor` runs padded batches
  eagerly, warms each token bucket up once and counts the padded shapes it
  has seen, so the conformance suite can prove no unprepared shape is served.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import numpy as np
import torch

from polyrunner.plugin_api import (
    Availability,
    Backend,
    BucketPolicy,
    Capabilities,
    GraphExecutor,
    ModelInputs,
    exponential_sizes,
    hookimpl,
)
from polyrunner_cpu_paged import kv_layout

logger = logging.getLogger(__name__)
DEFAULT_KV_CAP = 1 << 30


class PaddedEagerExecutor(GraphExecutor):
    """Eager execution of padded batches; a "graph" is a padded token count."""

    def __init__(self, model: torch.nn.Module, warm_up: bool = True) -> None:
        super().__init__(model)
        self.warm_up = warm_up
        self.shapes: set[int] = set()

    def prepare(self, run_dummy: Callable[[int, int], Any], buckets: BucketPolicy) -> None:
        if not self.warm_up:
            return
        top_r = buckets.request_buckets[-1] if buckets.request_buckets else 1
        for T in buckets.token_buckets:   # one run per token bucket: allocator and kernels warmed up
            run_dummy(T, min(T, top_r))
        logger.info("cpu_paged: warmed up %d token buckets", len(self.shapes))

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        self.shapes.add(int(inputs.input_ids.shape[0]))
        return self.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches)

    def num_graphs(self) -> int:
        return len(self.shapes)


class CPUPagedBackend(Backend):
    """Host CPU with a heads-major paged KV cache and TPU-style padding buckets."""

    name = "cpu_paged"
    priority = -10          # below the built-in `cpu`: chosen only by name
    # gloo: tensor-parallel ranks of this backend talk over torch.distributed's CPU communicator;
    # its SDPA attention honours sliding windows but has no logit soft cap (Gemma 2 is refused)
    capabilities = Capabilities(graph_mode="eager", static_shapes=True, counts_graphs=True,
                                distributed_backend="gloo", attention_features=frozenset({"sliding_window"}))
    kv_alignment_bytes = kv_layout.ALIGNMENT

    @classmethod
    def device_count(cls) -> int:   # ranks share the host's CPUs
        return len(os.sched_getaffinity(0))

    @classmethod
    def probe(cls) -> Availability:
        try:  # never raise: anything odd is "unavailable: <reason>"
            return Availability(True, "", f"cpu ({torch.get_num_threads()} threads, heads-major KV)")
        except Exception as exc:  # noqa: BLE001
            return Availability(False, f"{type(exc).__name__}: {exc}")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    # ---- padding -----------------------------------------------------------
    def bucket_policy(self) -> BucketPolicy:   # for self.config, the engine's configuration
        config = self.config
        sched = config.scheduler
        tokens = config.runner.token_buckets or exponential_sizes(1, sched.max_num_batched_tokens)
        reqs = config.runner.request_buckets or list(range(1, sched.max_num_seqs + 1))
        return BucketPolicy(sorted(set(tokens)), sorted(set(reqs)))

    # ---- KV cache ------------------------------------------------------------
    def kv_cache_budget(self, weights_bytes: int, profile) -> int:
        config = self.config
        profile()
        if config.cache.kv_cache_memory_bytes is not None:
            return config.cache.kv_cache_memory_bytes
        free, _ = self.memory_info()
        return int(min(DEFAULT_KV_CAP, free * config.cache.memory_utilization / 2))

    def allocate_kv_cache(self, spec, num_blocks: int) -> list[torch.Tensor]:
        return kv_layout.allocate(spec, num_blocks)

    attention = staticmethod(kv_layout.paged_attention)

    # ---- execution -------------------------------------------------------------
    def make_executor(self, model: torch.nn.Module) -> GraphExecutor:
        return PaddedEagerExecutor(model, warm_up=not self.config.runner.enforce_eager)

    # ---- host <-> device ---------------------------------------------------------
    def to_device(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(array) if isinstance(array, np.ndarray) else array

    def memory_info(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


PLUGIN_API_VERSION = "1.0"  # the plugin contract this plugin is written for (checked at registration)


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [CPUPagedBackend]
