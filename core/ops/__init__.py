"""Replaceable ops: the core's reference implementations, per role, and how a backend overrides them.

A model names its parts by role (`replaceable_modules()`); the role table (`roles.py`: `ROLES`)
gives each role's reference and the call a replacement keeps. A backend supplies a factory per
role (`Backend.op_overrides(dtype)`), which the core applies once at start-up with
`apply_overrides`, so no backend walks or patches a model itself (vLLM's CustomOp idea: a
supported way to put a device's kernel in a layer). The conformance suite's `ops` group compares
every factory's modules with the references on random cases (`cases.py`).

- `rms_norm.py`: `RMSNorm` ("rms_norm": `forward`, `forward_add`);
- `gated_mlp.py`: `GatedMLP` ("gated_mlp") and `silu_and_mul`;
- `rotary.py`: `RotaryEmbedding` ("rotary");
- `moe.py`: `FusedMoE` ("moe"), `select_experts` and `fused_experts` (the interface a device kernel implements);
- "linear" is `torch.nn.Linear`; "attention" is `reference_paged_attention`, overridden by
  `Backend.attention`.
"""

from __future__ import annotations

from polyrunner.ops.apply import OpFactory, apply_overrides, check_roles
from polyrunner.ops.gated_mlp import GatedMLP, silu_and_mul
from polyrunner.ops.moe import FusedMoE, fused_experts, keep_moe_attributes, select_experts
from polyrunner.ops.rms_norm import RMSNorm, RMSNormOverride
from polyrunner.ops.roles import MODULE_ROLES, ROLES, Role
from polyrunner.ops.rotary import RotaryEmbedding

__all__ = ["ROLES", "MODULE_ROLES", "Role", "OpFactory", "apply_overrides", "check_roles", "RMSNorm",
           "RMSNormOverride", "GatedMLP", "silu_and_mul", "RotaryEmbedding", "FusedMoE", "fused_experts",
           "keep_moe_attributes", "select_experts"]
