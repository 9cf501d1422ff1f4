"""The Qwen MoE family (`Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`): Qwen2's (qkv bias) or
Qwen3's (q/k norms) decoder with sparse blocks (`mlp.gate`, `mlp.experts.N.{gate,up,down}_proj`)
in the layers `decoder_sparse_step` / `mlp_only_layers` select (the others keep the dense
gated MLP), top-k renormalised when `norm_topk_prob`; Qwen2-MoE adds the shared expert
(`mlp.shared_expert.*`, scaled by `sigmoid(mlp.shared_expert_gate(x))`). See `moe_block.py`."""

from __future__ import annotations

from polyrunner.models.moe_block import MoEForCausalLM

QWEN_MOE_FAMILY = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


class QwenMoeForCausalLM(MoEForCausalLM):
    """Token ids + positions + attention metadata + KV caches -> hidden states; see `MoEForCausalLM`
    (its checkpoint names are the defaults)."""
