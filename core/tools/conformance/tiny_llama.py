"""A tiny random Llama written with plain torch (config.json + safetensors).

The suite must not need Hugging Face transformers at run time, so the model
folder is written by hand: the config keys `DecoderArch.from_hf_config` reads
and the tensor names of a Hugging Face Llama checkpoint. Weights are drawn
larger than a real model's so that logits are decisive (greedy near-ties,
which would make token-for-token comparisons flaky, are rare).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32",
)


def write_tiny_llama(folder: str | Path, seed: int = 0, std: float = 0.08, dtype: str = "float32",
                     **overrides) -> Path:
    """Write a random Llama to `folder` (weights in `dtype`); `overrides` change config keys."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_LLAMA, **overrides, torch_dtype=dtype)
    H, inter, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or H // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm(n: int) -> torch.Tensor:  # around 1, not exactly 1, so a dropped norm weight shows
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    tensors = {"model.embed_tokens.weight": rand(V, H), "model.norm.weight": norm(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(heads * head_dim, H),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, H),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, H),
            p + "self_attn.o_proj.weight": rand(H, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, H),
            p + "mlp.up_proj.weight": rand(inter, H),
            p + "mlp.down_proj.weight": rand(H, inter),
            p + "input_layernorm.weight": norm(H),
            p + "post_attention_layernorm.weight": norm(H),
        })
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(V, H)
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in tensors.items()},
              str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder
