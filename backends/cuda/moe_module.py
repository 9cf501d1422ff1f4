"""The CUDA backend's "moe" op override: the core's `FusedMoE` (`polyrunner.ops.moe`) with its
experts computed by the Triton fused-MoE kernel (`triton_moe.fused_experts`). Importing this
module imports triton.
"""

from __future__ import annotations

from torch import nn

from polyrunner.backends.cuda.triton_moe import fused_experts
from polyrunner.plugin_api import FusedMoE, keep_moe_attributes


class TritonFusedMoE(FusedMoE):
    """`forward(x [T, H], router_logits [T, E]) -> [T, H]` as the wrapped `FusedMoE`: the core's
    router selection (`select_experts`), then the Triton kernel as `experts`. Keeps the role's
    attributes (`w13_weight`, `w2_weight` - the same parameters - `num_experts`, `top_k`,
    `intermediate`, `renormalize`, `scoring`)."""

    experts = staticmethod(fused_experts)

    def __init__(self, module: nn.Module) -> None:
        nn.Module.__init__(self)
        keep_moe_attributes(self, module)
