"""The Phi-3 family (`Phi3ForCausalLM`, model_type phi3): the plain decoder of `decoder.py`
loaded from a checkpoint whose projections are already fused.

Phi-3 checkpoints hold `self_attn.qkv_proj` (q, k, v rows stacked) and `mlp.gate_up_proj`
(gate then up rows) — the decoder's own fused parameters, so each tensor fills its whole
parameter. With tensor parallelism a rank's slice is taken per part: the fused tensor is
split into q / k / v (gate / up), each sliced by `TPShard.slice`, and the slices stacked.
Longrope ("su") rotary scaling and the sliding window come from the architecture
(`polyrunner.ops.longrope`; `DecoderArch.sliding_windows`: transformers applies Phi-3's
`sliding_window` to every layer, and so does the decoder).
"""

from __future__ import annotations

from typing import Hashable

import torch

from polyrunner.models.decoder import DecoderForCausalLM

PHI3_FAMILY = ("Phi3ForCausalLM",)


class Phi3ForCausalLM(DecoderForCausalLM):
    """Token ids + positions + attention metadata + KV caches -> hidden states; see
    `DecoderForCausalLM`."""

    # vLLM's: each fused module is one checkpoint tensor
    packed_modules_mapping = {"qkv_proj": ["qkv_proj"], "gate_up_proj": ["gate_up_proj"]}
    # fused checkpoint module -> the unfused parts `TPShard.slice` knows, in row order
    _FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

    def weight_target(self, hf_name: str) -> tuple[str, Hashable] | None:
        """Checkpoint names are the parameters' (less "model."); each tensor fills its whole parameter."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (self.lm_head is None and name.startswith("lm_head")):
            return None
        return name, None

    def weight_parts(self, param_name: str) -> tuple[Hashable, ...]:
        return (None,)

    def shard_weight(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a fused tensor: each part's `TPShard.slice`, stacked; others as the decoder's."""
        module, kind = hf_name.split(".")[-2:]
        parts = self._FUSED_PARTS.get(module)
        if parts is None or self.shard.size == 1:
            return super().shard_weight(hf_name, tensor)
        a = self.arch
        sizes = ([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
                 if module == "qkv_proj" else [a.intermediate_size, a.intermediate_size])
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"weight {hf_name!r} has {tensor.shape[0]} rows, expected {sum(sizes)} "
                             f"({' + '.join(map(str, sizes))} for {', '.join(parts)})")
        pieces = torch.split(tensor, sizes, dim=0)
        return torch.cat([self.shard.slice(f"{part}.{kind}", piece) for part, piece in zip(parts, pieces)])
