"""Architecture facts parsed from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyrunner.models.gemma_config import gemma_arch_fields
from polyrunner.models.hf_config import HFDecoderConfig
from polyrunner.models.longrope import longrope_scaling
from polyrunner.models.moe_arch import MoEArch


@dataclass(frozen=True)
class DecoderArch:
    """Everything a Llama-family decoder needs; one instance per model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()   # per layer
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEArch | None = None   # the mixture-of-experts layers (Mixtral, Qwen2/3-MoE); None: dense
    # Gemma 2 / 3 (`gemma_config.gemma_arch_fields`); the defaults are the plain decoder's
    hidden_act: str = "silu"                            # the gated MLP's activation (ops.gated_mlp.ACTIVATIONS)
    query_pre_attn_scalar: float | None = None          # attention scale = this ** -0.5 (None: head_dim)
    attn_logit_softcapping: float | None = None         # every layer's LayerSpec.logits_soft_cap
    final_logit_softcapping: float | None = None        # logits become cap * tanh(logits / cap)
    embed_scale: float | None = None                    # embeddings times this (Gemma: sqrt(hidden_size))
    sliding_rope_theta: float | None = None             # rope base of sliding-window layers (None: rope_theta)
    sliding_rope_scaling: dict[str, Any] | None = None  # their rope scaling (with sliding_rope_theta)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str | Path = "config.json") -> "DecoderArch":
        """The architecture a parsed config.json describes. Every field read is
        checked first (`HFDecoderConfig`): a bad one raises ModelFileError (a
        ValueError; ModelConfigTypeError, also a TypeError, for a wrong type)
        naming `source` and the field."""
        c = HFDecoderConfig.from_file_dict(cfg, source)
        rope = dict(cfg[c.rope_field]) if c.rope_field else {}   # its values checked by `c.rope`
        rope_theta = float(rope.pop("rope_theta", None) or c.rope_theta or 10000.0)
        rope_type = c.rope.kind if c.rope is not None else "default"
        eos = c.eos_token_id
        arch = cls(
            architecture=(c.architectures or ["LlamaForCausalLM"])[0],
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
            head_dim=c.resolved_head_dim,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=(longrope_scaling(rope, c) if rope_type == "longrope" else
                          dict(rope, rope_type=rope_type) if rope_type != "default" else None),
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=c.tie_word_embeddings,
            qkv_bias=c.model_type in ("qwen2", "qwen2_moe") or c.attention_bias,
            o_bias=c.model_type not in ("qwen2", "qwen2_moe") and c.attention_bias,
            mlp_bias=c.mlp_bias,
            qk_norm=c.model_type in ("qwen3", "qwen3_moe"),
            sliding_windows=_sliding_windows(c),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            moe=MoEArch.from_config(c),
        )
        return dataclasses.replace(arch, **gemma_arch_fields(c))


def _sliding_windows(c: HFDecoderConfig) -> tuple[int | None, ...]:
    window, layers = c.sliding_window or None, c.num_hidden_layers   # 0: no window
    if window is None:
        return (None,) * layers
    if c.layer_types:
        return tuple(window if t == "sliding_attention" else None for t in c.layer_types)
    if c.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not c.use_sliding_window:
            return (None,) * layers
        start = layers if c.max_window_layers is None else c.max_window_layers
        return tuple(window if i >= start else None for i in range(layers))
    return (window,) * layers
