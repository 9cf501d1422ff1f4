"""Model classes by Hugging Face architecture name: the built-in families,
overridden or extended by plugins' `polyrunner_models` hook."""

from __future__ import annotations

from polyrunner.models.gemma import GEMMA_FAMILY, GemmaForCausalLM
from polyrunner.models.llama import LLAMA_FAMILY, LlamaForCausalLM
from polyrunner.models.mixtral import MIXTRAL_FAMILY, MixtralForCausalLM
from polyrunner.models.phi3 import PHI3_FAMILY, Phi3ForCausalLM
from polyrunner.models.qwen_moe import QWEN_MOE_FAMILY, QwenMoeForCausalLM
from polyrunner.plugins.manager import model_classes

# one entry per family file: architecture name -> class
BUILT_IN: dict[str, type] = {
    **{name: LlamaForCausalLM for name in LLAMA_FAMILY},
    **{name: GemmaForCausalLM for name in GEMMA_FAMILY},
    **{name: MixtralForCausalLM for name in MIXTRAL_FAMILY},
    **{name: QwenMoeForCausalLM for name in QWEN_MOE_FAMILY},
    **{name: Phi3ForCausalLM for name in PHI3_FAMILY},
}


def resolve_model_class(architecture: str) -> type:
    """The model class for an architecture name, or a ValueError listing the known ones.
    A plugin's class wins over the built-in one of the same name."""
    classes = {**BUILT_IN, **model_classes()}
    if architecture not in classes:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(classes))}")
    return classes[architecture]
