"""Gemma 2 / Gemma 3 facts of a validated config.json, as `DecoderArch` fields.

Defaults are transformers' per model type where config.json leaves a field out
(Gemma 2: caps 50 / 30, every other layer sliding; Gemma 3: no caps, a sliding
pattern of 6, rope bases 1e6 global / 1e4 local). Both rope formats are read:
transformers 5.x's `rope_parameters` keyed by layer type, and the older
`rope_theta` + `rope_local_base_freq` + `rope_scaling` (global layers only).
"""

from __future__ import annotations

from typing import Any

from polyrunner.models.hf_config import GEMMA_MODEL_TYPES, HFDecoderConfig, RopeConfig

_DEFAULT_WINDOW = 4096
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def gemma_arch_fields(c: HFDecoderConfig) -> dict[str, Any]:
    """`DecoderArch` fields that Gemma sets or overrides ({} for another model type)."""
    if c.model_type not in GEMMA_MODEL_TYPES:
        return {}
    gemma2 = c.model_type == "gemma2"
    caps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if gemma2 else {}
    for key in caps:   # an explicit null turns a cap off
        if key in c.model_fields_set:
            caps[key] = getattr(c, key)
    window = (c.sliding_window or None) if "sliding_window" in c.model_fields_set else _DEFAULT_WINDOW   # 0: none
    layer_types = c.layer_types or _layer_types(c.num_hidden_layers, 2 if gemma2 else c.sliding_window_pattern or 6)
    full_theta, full_scaling = _rope(c, "full_attention")
    sliding_theta, sliding_scaling = _rope(c, "sliding_attention")
    return dict(
        hidden_act=c.hidden_activation or c.hidden_act or "gelu_pytorch_tanh",
        query_pre_attn_scalar=c.query_pre_attn_scalar or 256.0,
        embed_scale=float(c.hidden_size) ** 0.5,
        tie_word_embeddings=c.tie_word_embeddings if "tie_word_embeddings" in c.model_fields_set else True,
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in layer_types),
        qk_norm=not gemma2,
        rope_theta=full_theta, rope_scaling=full_scaling,
        sliding_rope_theta=sliding_theta, sliding_rope_scaling=sliding_scaling,
        **caps,
    )


def _layer_types(num_layers: int, pattern: int) -> list[str]:
    """transformers' default: every `pattern`-th layer global, the others sliding."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def _rope(c: HFDecoderConfig, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(rope base, rope scaling or None) of `layer_type`'s layers."""
    params = c.rope_parameters
    keyed = None if params is None else getattr(params, layer_type)
    if keyed is not None:                                   # transformers 5.x, Gemma 3
        return keyed.rope_theta or _GEMMA3_THETA[layer_type], _scaling(keyed)
    flat = c.rope if c.rope_field is not None and not _is_keyed(c.rope) else None
    if c.model_type == "gemma2":                            # one rope for every layer
        return (flat.rope_theta if flat else None) or c.rope_theta or 10_000.0, _scaling(flat)
    if layer_type == "sliding_attention":                   # older Gemma 3: a plain local base
        return c.rope_local_base_freq or _GEMMA3_THETA[layer_type], None
    return (flat.rope_theta if flat else None) or c.rope_theta or _GEMMA3_THETA[layer_type], _scaling(flat)


def _is_keyed(rope: RopeConfig | None) -> bool:
    return rope is not None and (rope.full_attention is not None or rope.sliding_attention is not None)


def _scaling(rope: RopeConfig | None) -> dict[str, Any] | None:
    """The rotary module's scaling dict (None: default rope)."""
    if rope is None or rope.kind == "default":
        return None
    fields = rope.model_dump(exclude_none=True, exclude={"rope_theta", "type", "full_attention", "sliding_attention"})
    return dict(fields, rope_type=rope.kind)
