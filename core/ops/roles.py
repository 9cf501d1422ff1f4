"""The replaceable roles: the one table of what each role is.

A model names its parts by role through its optional `replaceable_modules()` hook (yielding
`(role, parent, attribute, module)`); a backend replaces them through `Backend.op_overrides`
(one factory per role, applied by `apply_overrides`), except "attention", whose override is
the backend's `Backend.attention` member itself. Each role has one reference in the core and
the call its replacement must keep: the same call, the same result within the dtype's
tolerance (`polyrunner.ops.cases.TOLERANCE`). The conformance suite's `ops` group compares
every replacement with the reference on the role's random cases; `execution` checks the
attention (`execution::attention_matches_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from polyrunner.attention.reference import reference_paged_attention
from polyrunner.ops.cases import (
    CaseMaker,
    gated_mlp_cases,
    linear_cases,
    lora_cases,
    lora_embedding_cases,
    moe_cases,
    rms_norm_cases,
    rotary_cases,
)
from polyrunner.ops.gated_mlp import GatedMLP
from polyrunner.ops.lora import LoRAEmbedding, LoRALinear
from polyrunner.ops.moe import FusedMoE
from polyrunner.ops.rms_norm import RMSNorm
from polyrunner.ops.rotary import RotaryEmbedding


@dataclass(frozen=True)
class Role:
    name: str
    reference: Any            # the core's implementation (a module class, or the attention function)
    signature: str            # the call a replacement keeps
    cases: CaseMaker | None   # random cases for the `ops` conformance group (None: attention, checked elsewhere)


LINEAR = Role("linear", nn.Linear, (
    "forward(x [..., in_features]) -> [..., out_features] = x @ weight.T + bias: an nn.Linear the model "
    "only calls (nothing reads its weight; never the LM head). It may already be another module with that "
    "call (a quantized linear from `Backend.quantize_model`): keep what you do not accelerate."), linear_cases)
RMS_NORM = Role("rms_norm", RMSNorm, (
    "forward(x [..., H]) -> [..., H] and forward_add(x, residual) -> (norm(x + residual), x + residual); "
    "attributes weight [H] and eps, which a replacement keeps; normalise in float32, scale by weight in the "
    "input dtype."), rms_norm_cases)
ROTARY = Role("rotary", RotaryEmbedding, (
    "forward(positions [T], q [T, Hq, D], k [T, Hkv, D]) -> (q, k), over the float32 cos/sin tables "
    "[max_positions, D] (rotate_half layout); q and k may be strided views of one projection, and a "
    "replacement may rotate them in place. One module shared by several parents: replaced once."), rotary_cases)
GATED_MLP = Role("gated_mlp", GatedMLP, (
    "forward(x [..., H]) -> [..., H] = down_proj(silu_and_mul(gate_up_proj(x))); attributes gate_up_proj "
    "(gate then up, intermediate columns each), down_proj and intermediate, which a replacement keeps (the "
    "model's hook reaches the linears through them). Replaced after the linears in it, so its factory sees "
    "their replacements. Only SiLU MLPs (activation == 'silu') are offered in this role (a GeGLU is not)."),
    gated_mlp_cases)
MOE = Role("moe", FusedMoE, (
    "forward(x [T, H], router_logits [T, E]) -> [T, H] = fused_experts(x, w13_weight, w2_weight, "
    "*select_experts(router_logits, top_k, renormalize, scoring)) (polyrunner.ops.moe): each token's top_k "
    "experts' gated MLPs (w13_weight [E, 2I, H]: gate then up rows; w2_weight [E, H, I]) summed by the "
    "routing weights; attributes num_experts, top_k, intermediate, renormalize, scoring and both weights, "
    "which a replacement keeps. The router is a separate \"linear\"."), moe_cases)
LORA = Role("lora", LoRALinear, (
    "forward(x [T, in]) -> [T, out] = add_lora(base(x), x, lora_a, lora_b, mapping.token_lora[:T]) "
    "(polyrunner.ops.lora): each token's adapter slot (-1: none) adds (x @ lora_a[slot].T) @ lora_b[slot].T; "
    "attributes base, lora_a [L, S*R, in], lora_b [L, out, S*R] (block diagonal per output slice, scaling "
    "folded in), output_slices, max_rank and mapping, which a replacement keeps and reads at call time "
    "(adapters are written into the slots in place). Wrapped around the linears after the other roles' "
    "overrides, only when LoRA is enabled."), lora_cases)
LORA_EMBEDDING = Role("lora_embedding", LoRAEmbedding, (
    "forward(input_ids [T], x [T, H]) -> [T, H] = add_lora_embedding(x, input_ids, lora_a, lora_b, "
    "mapping.token_lora[:T]) (polyrunner.ops.lora): a token of slot l (-1: none) adds lora_a[l, id] @ "
    "lora_b[l].T to its embedding; attributes lora_a [L, V, R], lora_b [L, H, R] (scaling folded in) and "
    "mapping, which a replacement keeps and reads at call time. Runs inside the captured decode graphs; "
    "present only when LoRA is enabled."), lora_embedding_cases)
ATTENTION = Role("attention", reference_paged_attention, (
    "Backend.attention(q, k, v, kv_cache, meta, spec) -> [T_pad, Hq, D]: write this step's k/v at "
    "meta.slot_mapping, then attend each request's queries to its context. Overridden by defining "
    "Backend.attention, not through op_overrides."), None)

ROLES: dict[str, Role] = {r.name: r for r in (LINEAR, RMS_NORM, ROTARY, GATED_MLP, MOE, LORA, LORA_EMBEDDING,
                                              ATTENTION)}
# the roles `Backend.op_overrides` may name, in the order `apply_overrides` replaces them (innermost first)
MODULE_ROLES: tuple[str, ...] = (LINEAR.name, RMS_NORM.name, ROTARY.name, GATED_MLP.name, MOE.name, LORA.name,
                                 LORA_EMBEDDING.name)
