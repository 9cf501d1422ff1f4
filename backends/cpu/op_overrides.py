"""The CPU backend's op overrides (`Backend.op_overrides`), which the core applies.

- "linear" (bfloat16): `LinearPacker`, a bfloat16 `nn.Linear` -> `PackedLinear` (`packed_linear.py`),
  where oneDNN packs bfloat16 (`POLYRUNNER_CPU_PACK`);
- "rms_norm", "rotary", "gated_mlp" (bfloat16 and float32): the fused C++ modules
  (`fused_modules.py`), with the kernel library (`POLYRUNNER_CPU_FUSE`); with quantized linears
  (`quant_linear.py`) they make a float32 GGUF model's decode step all C++ kernels, so it is
  graph-captured (`executor.py`);
- "moe" (bfloat16): `MoEOverride`, the experts as one C++ call per layer (`moe_module.py`), with the
  kernel library (`POLYRUNNER_CPU_MOE`);
- "lora" (only with LoRA enabled): `LoRAOverride`, the adapters' updates as one C++ call per
  LoRA linear (`lora_module.py`), with the kernel library.

A float16 model keeps the core's modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from polyrunner.backends.cpu import envs, kernels, threads
from polyrunner.backends.cpu.fused_modules import FUSED_DTYPES, FusedMLP, FusedRMSNorm, FusedRotary
from polyrunner.backends.cpu.host_memory import keep_freed_memory
from polyrunner.backends.cpu.lora_module import lora_overrides
from polyrunner.backends.cpu.moe_module import MoEOverride
from polyrunner.backends.cpu.packed_linear import PackedLinear, Shape, packing_supported, planned
from polyrunner.plugin_api import EngineConfig, graph_token_sizes


class LinearPacker:
    """The "linear" factory: a bfloat16 `nn.Linear` -> a `PackedLinear` running the kernels
    measured fastest here per row count up to `batch_hint` (the step's token budget) at its weight
    shape; `align`: the graphs' batch sizes (see `kernel_table.plan`). Any other module (a
    `QuantLinear`, another dtype) is kept. Each weight shape is planned once, timed on every
    layer of that shape (`prepare`, which the core calls with all the model's linears first)."""

    def __init__(self, batch_hint: int, align: Sequence[int] = ()) -> None:
        self.batch_hint = batch_hint
        self.align = tuple(align)
        self.plans: dict[Shape, tuple[str, ...]] = {}
        self.reports: dict[Shape, str] = {}

    @staticmethod
    def packs(module: nn.Module) -> bool:
        return type(module) is nn.Linear and module.weight.dtype == torch.bfloat16

    def prepare(self, modules: Sequence[nn.Module]) -> None:
        """Plan the weight shapes of `modules` not planned yet (linears without a bias; with one,
        oneDNN runs every row count), timing the kernels on all of a shape's layers."""
        by_shape: dict[Shape, list[torch.Tensor]] = {}
        for m in modules:
            if self.packs(m) and m.bias is None and _shape(m) not in self.plans:
                by_shape.setdefault(_shape(m), []).append(m.weight.detach())
        if not by_shape:
            return
        keep_freed_memory()            # timed as the engine will run them: no page faults on temporaries,
        count = threads.start_pool()   # on the engine's pool and thread count
        plans, report = planned(by_shape, self.batch_hint, count, self.batch_hint, self.align)
        self.plans.update(plans)
        self.reports.update(dict.fromkeys(plans, report))

    def __call__(self, module: nn.Module) -> nn.Module:
        if not self.packs(module):
            return module
        self.prepare([module])   # no-op once planned
        shape = _shape(module)
        return PackedLinear(module.weight, module.bias, self.batch_hint, self.plans.get(shape, ("onednn",)),
                            self.reports.get(shape, ""))


def _shape(linear: nn.Module) -> Shape:
    return (linear.weight.shape[0], linear.weight.shape[1])


def fused_rms_norm(norm: nn.Module) -> nn.Module:
    """The "rms_norm" factory: `FusedRMSNorm` for a bfloat16 or float32 weight, else the norm itself."""
    return FusedRMSNorm(norm) if norm.weight.dtype in FUSED_DTYPES else norm


def cpu_op_overrides(config: EngineConfig, dtype: torch.dtype) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """The factories for a model in `dtype` under `config` (see the module docstring)."""
    overrides: dict[str, Callable[[nn.Module], nn.Module]] = dict(lora_overrides(config, dtype))
    if packing_supported(dtype):
        overrides["linear"] = LinearPacker(max(64, min(config.scheduler.max_num_batched_tokens, 2048)),
                                           graph_token_sizes(config))
    if dtype in FUSED_DTYPES and envs.FUSE.get() and kernels.paged_attention_kernel() is not None:
        overrides.update(rms_norm=fused_rms_norm, rotary=FusedRotary, gated_mlp=FusedMLP)
    if dtype == torch.bfloat16 and envs.MOE.get() and kernels.paged_attention_kernel() is not None:
        overrides["moe"] = MoEOverride(max(64, config.scheduler.max_num_batched_tokens))
    return overrides
