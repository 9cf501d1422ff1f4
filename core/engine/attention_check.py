"""Refusing, at start, a model whose attention needs a feature the backend lacks
(`Capabilities.attention_features`) rather than computing something else."""

from __future__ import annotations

from polyrunner.device.backend import Backend
from polyrunner.models.arch import DecoderArch


def required_attention_features(arch: DecoderArch) -> set[str]:
    """The `ATTENTION_FEATURES` the model's layers use: "sliding_window" when a layer has a
    window, "logits_soft_cap" when its attention scores are capped."""
    needed = set()
    if any(w is not None for w in arch.sliding_windows):
        needed.add("sliding_window")
    if arch.attn_logit_softcapping is not None:
        needed.add("logits_soft_cap")
    return needed


def check_attention_features(arch: DecoderArch, backend: Backend) -> None:
    """ValueError naming the model, the backend and each feature it needs but the backend lacks."""
    missing = sorted(required_attention_features(arch) - set(backend.capabilities.attention_features))
    if missing:
        raise ValueError(
            f"model {arch.architecture} needs attention feature(s) {', '.join(missing)}, which backend "
            f"{backend.name!r} does not support (Capabilities.attention_features = "
            f"{sorted(backend.capabilities.attention_features)}); choose a backend that supports them")
