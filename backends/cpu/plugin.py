"""CPU backend plugin."""

from __future__ import annotations

import os

import torch

from polyrunner.backend import Availability, Backend, Capabilities
from polyrunner.plugins import hookimpl
from polyrunner.backends.cpu.attention import cpu_paged_attention


class CPUBackend(Backend):
    """Host memory, eager PyTorch, no padding buckets; always available."""

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

    def to_device(self, array):
        return torch.from_numpy(array) if not isinstance(array, torch.Tensor) else array

    attention = staticmethod(cpu_paged_attention)


@hookimpl
def polyrunner_backends() -> list[type[Backend]]:
    return [CPUBackend]
