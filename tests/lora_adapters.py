"""PEFT LoRA adapters made with `peft` for tests: random, nonzero, saved as a PEFT folder.

`make_peft_adapter(base, out_dir, rank, targets, seed)` wraps a Hugging Face causal LM in
`peft.get_peft_model`, redraws every LoRA tensor (peft starts lora_B / lora_embedding_A at
zero, an adapter that changes nothing) and saves `adapter_config.json` +
`adapter_model.safetensors` to `out_dir`. Reference outputs: `merged_model(base, path)` is
peft's `merge_and_unload()` of the adapter on the base model (float32).

On a model with tied embeddings, merging an `embed_tokens` or `lm_head` adapter changes the
shared matrix (both ends): compare such adapters with peft's unmerged model instead.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ATTENTION + MLP
_LORA_TENSORS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def _load_base(base: Any):
    """A float32 copy of `base` (a model folder or a transformers model; the caller's model is never changed)."""
    if isinstance(base, (str, Path)):
        import transformers as tf
        return tf.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    return copy.deepcopy(base).float()


def make_peft_adapter(base: Any, out_dir: str | Path, rank: int, targets, seed: int = 0,
                      with_embed: bool = False, with_lm_head: bool = False, *, lora_alpha: float | None = None,
                      init_std: float = 0.1, safe_serialization: bool = True, **lora_config: Any) -> str:
    """Save a random LoRA adapter for `base` (a HF model folder or a transformers model) to
    `out_dir`; returns the folder as a str (for `LoRARequest(name, id, path)`).

    `targets`: HF module names (`ATTENTION`, `MLP`, `ALL_LINEAR`, or any of them);
    `with_embed` / `with_lm_head` add `embed_tokens` / `lm_head`. `lora_alpha` defaults to
    2 * rank. Every LoRA tensor is redrawn from N(0, init_std) with `seed` (0.1: an update of
    about half the tiny models' N(0, 0.08) weights at rank 8, enough to change greedy tokens).
    `lora_config`: further `peft.LoraConfig` fields (use_rslora, rank_pattern, alpha_pattern,
    layers_to_transform, use_dora, modules_to_save, ...). `safe_serialization=False` saves the
    weights as `adapter_model.bin` instead (for the refusal test)."""
    from peft import LoraConfig, get_peft_model

    modules = [*targets, *(["embed_tokens"] if with_embed else []), *(["lm_head"] if with_lm_head else [])]
    config = LoraConfig(r=rank, lora_alpha=2 * rank if lora_alpha is None else lora_alpha, lora_dropout=0.0,
                        target_modules=modules, **lora_config)
    model = get_peft_model(_load_base(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if any(f".{kind}." in f"{name}." for kind in _LORA_TENSORS):
                param.copy_(torch.randn(param.shape, generator=gen) * init_std)
    out = Path(out_dir)
    model.save_pretrained(str(out), safe_serialization=safe_serialization)
    return str(out)


def merged_model(base: Any, adapter_path: str | Path):
    """peft's reference for an adapter: `base` (folder or model, copied) with the adapter merged in."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_load_base(base), str(adapter_path)).merge_and_unload().eval()
