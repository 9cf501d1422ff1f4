"""Model classes by Hugging Face architecture name; plugins may add more."""

from __future__ import annotations

from polyrunner.models.llama import LlamaForCausalLM
from polyrunner.plugins.hookspecs import hookimpl

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@hookimpl
def polyrunner_models() -> dict[str, type]:
    return {name: LlamaForCausalLM for name in LLAMA_FAMILY}


def resolve_model_class(architecture: str) -> type:
    """The model class for an architecture name, or a ValueError listing the known ones."""
    from polyrunner.plugins import get_plugin_manager

    classes: dict[str, type] = {}
    for contributed in reversed(get_plugin_manager().hook.polyrunner_models()):
        classes.update(contributed or {})
    if architecture not in classes:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(classes))}")
    return classes[architecture]
