"""The mixture-of-experts facts of a config.json (`DecoderArch.moe`): Mixtral, Qwen2-MoE, Qwen3-MoE."""

from __future__ import annotations

from dataclasses import dataclass

from polyrunner.models.hf_config import MOE_MODEL_TYPES, HFDecoderConfig


@dataclass(frozen=True)
class MoEArch:
    """What a model's sparse blocks need. A layer whose `sparse_layers` entry is False has the
    dense gated MLP of width `DecoderArch.intermediate_size` instead."""

    num_experts: int
    top_k: int                           # experts per token (num_experts_per_tok)
    intermediate: int                    # each expert's width (Mixtral: intermediate_size)
    renormalize: bool                    # the top-k weights divided by their sum (Mixtral: always)
    sparse_layers: tuple[bool, ...]      # per layer
    shared_expert_intermediate: int = 0  # Qwen2-MoE's gated shared expert (0: none)
    scoring: str = "softmax"

    @classmethod
    def from_config(cls, c: HFDecoderConfig) -> MoEArch | None:
        """The mixture of experts of a validated config (None: a dense model type)."""
        if c.model_type not in MOE_MODEL_TYPES:
            return None
        experts, k = c.num_routed_experts, c.num_experts_per_tok
        assert experts is not None and k is not None   # checked by HFDecoderConfig
        layers = range(c.num_hidden_layers)
        if c.model_type == "mixtral":
            return cls(experts, k, c.intermediate_size, True, (True,) * len(layers))
        assert c.moe_intermediate_size is not None
        # Hugging Face's rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer
        sparse = tuple(i not in c.mlp_only_layers and (i + 1) % c.decoder_sparse_step == 0 for i in layers)
        shared = (c.shared_expert_intermediate_size or 0) if c.model_type == "qwen2_moe" else 0
        return cls(experts, k, c.moe_intermediate_size, c.norm_topk_prob, sparse, shared)

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.sparse_layers)
