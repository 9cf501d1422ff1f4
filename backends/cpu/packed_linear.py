"""bfloat16 linears packed for the kernels measured fastest on this machine (`kernel_table.py`).

Every bfloat16 "linear" of a model (the "linear" op override, `op_overrides.py`) and the LM head
(for the logits, `executor.py`) become a `PackedLinear`: per row count, the kernel whose time at
its weight shape was lowest (AMX tiles `linear_amx.cpp`, AVX512_BF16 dot products
`linear_bf16.cpp`, AVX-512F float32 FMAs `linear_avx512.cpp`, oneDNN's packed matmul; timed at
the first start, then cached). Steps of at most `POOL_STEP_ROWS` rows choose among the pool's
kernels (AMX, AVX512_BF16, AVX-512F) where the CPU has one, so they stay graph-replayable; CPUs
without AVX-512 keep oneDNN. `POLYRUNNER_CPU_LINEAR` forces one kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polyrunner.backends.cpu import envs, kernel_table, linear_prefetch
from polyrunner.backends.cpu.row_linear import RowLinear

Shape = tuple[int, int]


class PackedLinear(RowLinear):
    """A bfloat16 linear layer packed for the kernels `plan` names, one per row count (chosen by
    measurement, `kernel_table.py`): a step of M rows runs `plan[min(M, len(plan) - 1)]`, and only
    the kernels the plan names keep a packed copy. With a bias: oneDNN only. `report`: the kernel
    table (times and choices) the plan came from, '' when none."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int,
                 plan: tuple[str, ...] = ("onednn",), report: str = "") -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.plan = plan if bias is None else ("onednn",)
        self.report = report if bias is None else ""
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        for kernel in dict.fromkeys(self.plan):
            self.register_buffer(f"packed_{kernel}", kernel_table.pack(kernel, weight, batch_hint), persistent=False)
        self._by_rows = [(kernel_table.runner(k), getattr(self, f"packed_{k}")) for k in self.plan]
        self.pool_rows = kernel_table.pool_prefix(self.plan)   # steps up to this many rows run on the pool

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        fn, packed = self._by_rows[min(x.shape[0], len(self._by_rows) - 1)]
        return fn(x, packed, self.out_features, self.bias)


def packing_supported(dtype: torch.dtype) -> bool:
    if dtype != torch.bfloat16 or not envs.PACK.get():
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def planned(weights: dict[Shape, list[torch.Tensor]], hint: int, threads: int, limit: int,
            align: Sequence[int] = ()) -> tuple[dict[Shape, tuple[str, ...]], str]:
    """`kernel_table.plans(...)` and the report (kernel table) it made, timed (where not cached) and
    run at the prefetch level `linear_prefetch.choose` sets."""
    linear_prefetch.choose(threads)
    before = len(kernel_table.reports)
    plans = kernel_table.plans(weights, hint, threads, limit, align)
    return plans, "\n".join(kernel_table.reports[before:])


def pack_lm_head(weight: torch.Tensor, max_rows: int, threads: int = 1) -> PackedLinear:
    """The LM head's packed copy for the logits (steps of at most `max_rows` requests)."""
    shape = (weight.shape[0], weight.shape[1])
    plans, report = planned({shape: [weight.detach()]}, max_rows, threads, max_rows)
    return PackedLinear(weight, None, max_rows, plans[shape], report)
