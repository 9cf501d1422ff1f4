"""Tiny random Gemma 2 / Gemma 3 text models saved with transformers (float32), for parity tests.

Sliding window 8 (prompts of 20-60 tokens cross it); Gemma 2 with attention and final
logit soft caps of 5.0 and a query_pre_attn_scalar of 1, so the scores reach the cap;
Gemma 3 with a linear-scaled global rope, its own local rope base and q/k norms.
Weights are drawn larger than transformers' init (norm weights too, which Gemma adds 1
to), so greedy tokens are decisive and every norm's weight matters."""

from __future__ import annotations

from pathlib import Path

import torch

KINDS = ("gemma2", "gemma3")
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=8)


def gemma_config(kind: str):
    import transformers as tf
    if kind == "gemma2":   # every other layer sliding (transformers' default layer_types)
        return tf.Gemma2Config(**COMMON, query_pre_attn_scalar=1, attn_logit_softcapping=5.0,
                               final_logit_softcapping=5.0, tie_word_embeddings=False)
    if kind == "gemma3":   # layers 0 and 2 sliding
        cfg = tf.Gemma3TextConfig(**COMMON, query_pre_attn_scalar=4, sliding_window_pattern=2,
                                  rope_local_base_freq=100.0, rope_theta=20000.0,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0})
        cfg.architectures = ["Gemma3ForCausalLM"]
        return cfg
    raise ValueError(kind)


def build_tiny_gemma(kind: str, folder: Path, seed: int = 0):
    """Save a random model of `kind` (float32) to `folder`; returns the HF model."""
    import transformers as tf
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(gemma_config(kind), dtype=torch.float32)
    embed_std = 0.02 if kind == "gemma2" else 0.06   # times sqrt(hidden_size) = 8 in the model
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, embed_std if "embed" in name else 0.3 if "lm_head" in name or p.dim() == 1 else 0.08)
    model.eval()
    model.save_pretrained(folder)
    return model
