"""CPU backend plugin."""

from __future__ import annotations

import os

import torch

from polyrunner.attention.metadata import NULL_BLOCK
from polyrunner.device.backend import Availability, Backend, Capabilities
from polyrunner.plugins import hookimpl
from polyrunner.backends.cpu.attention import cpu_paged_attention
from polyrunner.backends.cpu.executor import CPUExecutor


DEFAULT_KV_CAP = 4 << 30


class CPUBackend(Backend):
    """Host memory; eager PyTorch with oneDNN-packed bf16 weights (AMX-packed
    for decode-sized steps), C++ paged-attention and fused elementwise kernels;
    no padding buckets; always available."""

    name = "cpu"
    priority = 0
    capabilities = Capabilities(graph_mode="eager")

    @classmethod
    def probe(cls) -> Availability:
        return Availability(True, "", f"cpu ({torch.get_num_threads()} threads)")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def kv_cache_budget(self, config, weights_bytes, profile) -> int:
        """`kv_cache_memory_bytes`, else 4 GiB capped at half the free host memory.
        No profile run: activations on the host are small next to free RAM."""
        if config.cache.kv_cache_memory_bytes is not None:
            return config.cache.kv_cache_memory_bytes
        free, _ = self.memory_info()
        return int(min(DEFAULT_KV_CAP, free * config.cache.memory_utilization / 2))

    def allocate_kv_cache(self, spec, num_blocks):
        """Uninitialised host memory (every slot is written before it is read),
        except the null block, which padded requests may read."""
        caches = [torch.empty(spec.layer_shape(num_blocks), dtype=spec.dtype) for _ in range(spec.num_layers)]
        for cache in caches:
            cache[:, NULL_BLOCK].zero_()
        return caches

    def to_device(self, array):
        return torch.from_numpy(array) if not isinstance(array, torch.Tensor) else array

    def make_executor(self, model, config):
        return CPUExecutor(model, config)

    attention = staticmethod(cpu_paged_attention)


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [CPUBackend]
