"""The CUDA backend's "lora" op override: the core's `LoRALinear` with the adapters' updates
added by the Triton shrink and expand kernels (`triton_lora.add_lora_linear`). Importing this
module imports triton.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from polyrunner.backends.cuda.triton_lora import DTYPES, add_lora_linear, slice_bounds
from polyrunner.plugin_api import EngineConfig, LoRALinear, LoRAMapping, add_lora, keep_lora_attributes

# the role's attributes a replacement keeps (the same objects: parameters, base module, mapping)


class TritonLoRALinear(nn.Module):
    """`forward(x [T, in]) -> [T, out]` as the wrapped `LoRALinear`: `base(x)`, then the Triton
    kernels add each token's update in place, reading `lora_a`, `lora_b` and
    `mapping.token_lora[:T]` at call time (no host synchronisation: graph-capturable). Keeps the
    role's attributes; inputs the kernels do not take (another dtype, a row stride) add the
    updates by the reference `add_lora`."""

    base: nn.Module
    in_features: int
    output_slices: tuple[int, ...]
    max_rank: int
    mapping: LoRAMapping
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        keep_lora_attributes(self, module)
        self.bounds = slice_bounds(self.output_slices, self.lora_a.device)

    @property
    def max_loras(self) -> int:
        return int(self.lora_a.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        token_lora = self.mapping.token_lora[: x.shape[0]]
        if (x.dtype != self.lora_a.dtype or y.dtype != x.dtype or x.dim() != 2 or x.stride(-1) != 1
                or y.dim() != 2 or y.stride(-1) != 1 or token_lora.device != y.device):
            return add_lora(y, x, self.lora_a, self.lora_b, token_lora)
        return add_lora_linear(y, x, self.lora_a, self.lora_b, token_lora, self.output_slices, self.bounds)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, output_slices={self.output_slices}, max_loras={self.max_loras}, "
                f"max_rank={self.max_rank}")


def triton_lora(module: nn.Module) -> nn.Module:
    """The "lora" factory: a `LoRALinear` with contiguous slots in a kernel dtype -> `TritonLoRALinear`;
    anything else is kept."""
    if (type(module) is not LoRALinear or module.lora_a.dtype not in DTYPES
            or module.lora_b.dtype != module.lora_a.dtype
            or not (module.lora_a.is_contiguous() and module.lora_b.is_contiguous())):
        return module
    return TritonLoRALinear(module)


def lora_overrides(config: EngineConfig) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """{"lora": triton_lora} when LoRA is enabled (`config.lora`: the core wraps linears in
    `LoRALinear` only then), else {}."""
    return {"lora": triton_lora} if getattr(config, "lora", None) is not None else {}
