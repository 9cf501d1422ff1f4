"""The CUDA backend's "moe" op override: the core's `FusedMoE` (`polyrunner.ops.moe`) with its
experts computed by the Triton fused-MoE kernel (`triton_moe.fused_experts`). Importing this
module imports triton.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from polyrunner.backends.cuda.triton_moe import fused_experts
from polyrunner.plugin_api import FusedMoE, select_experts


class TritonFusedMoE(nn.Module):
    """`forward(x [T, H], router_logits [T, E]) -> [T, H]` as the wrapped `FusedMoE`: the core's
    router selection (`select_experts`), then the Triton kernel. Keeps the role's attributes
    (`w13_weight`, `w2_weight` - the same parameters - `num_experts`, `top_k`, `intermediate`,
    `renormalize`, `scoring`)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        moe = cast(FusedMoE, module)   # the reference, or a module keeping its attributes
        self.w13_weight, self.w2_weight = moe.w13_weight, moe.w2_weight
        self.num_experts, self.top_k, self.intermediate = moe.num_experts, moe.top_k, moe.intermediate
        self.renormalize, self.scoring = moe.renormalize, moe.scoring

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize, self.scoring)
        return fused_experts(x, self.w13_weight, self.w2_weight, weights, ids)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate}, "
                f"renormalize={self.renormalize}, scoring={self.scoring!r}")
