"""Model classes by Hugging Face architecture name: the built-in Llama family,
overridden or extended by plugins' `polyrunner_models` hook."""

from __future__ import annotations

from polyrunner.models.llama import LlamaForCausalLM
from polyrunner.plugins.manager import model_classes

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def resolve_model_class(architecture: str) -> type:
    """The model class for an architecture name, or a ValueError listing the known ones.
    A plugin's class wins over the built-in one of the same name."""
    classes: dict[str, type] = {name: LlamaForCausalLM for name in LLAMA_FAMILY}
    classes.update(model_classes())
    if architecture not in classes:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(classes))}")
    return classes[architecture]
