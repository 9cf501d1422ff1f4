"""The Mixtral family (`MixtralForCausalLM`): Mistral's decoder with a sparse block in every
layer (`block_sparse_moe`: router `gate`, experts `w1` gate, `w3` up, `w2` down; softmax
top-k, always renormalised). See `moe_block.py`."""

from __future__ import annotations

from polyrunner.models.moe_block import MoEForCausalLM

MIXTRAL_FAMILY = ("MixtralForCausalLM",)


class MixtralForCausalLM(MoEForCausalLM):
    """Token ids + positions + attention metadata + KV caches -> hidden states; see `MoEForCausalLM`."""

    block_name = "block_sparse_moe"
    expert_parts = {"w1": "gate", "w3": "up", "w2": "down"}
