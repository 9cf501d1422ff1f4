"""Tiny random Hugging Face models saved to disk, for parity tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def hf_config(kind: str):
    import transformers as tf
    if kind == "llama":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=False,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "llama_tied":
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=True)
    if kind == "mistral":
        return tf.MistralConfig(**COMMON, sliding_window=48, tie_word_embeddings=False)
    if kind == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=False)
    if kind == "llama_odd":   # 3 KV heads: two ranks need a zero KV head (like SmolLM2's 9 / 3)
        return tf.LlamaConfig(**{**COMMON, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3},
                              tie_word_embeddings=False, attention_bias=True)
    if kind == "llama_mqa":   # one KV head: tensor parallelism replicates it
        return tf.LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True)
    if kind == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)
    if kind == "phi3":   # fused qkv / gate_up in the checkpoint; a window shorter than the longest sequences
        return tf.Phi3Config(**COMMON, sliding_window=48, tie_word_embeddings=False, pad_token_id=0)
    if kind == "phi3_longrope":   # long factors from position 32 on; attention factor sqrt(1 + ln 4 / ln 32)
        half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
        rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.05 * i for i in range(half)],
                    long_factor=[1.0 + 0.7 * i for i in range(half)])
        return tf.Phi3Config(**{**COMMON, "max_position_embeddings": 128}, original_max_position_embeddings=32,
                             rope_parameters=rope, tie_word_embeddings=True, pad_token_id=0)
    raise ValueError(kind)


def build_tiny_model(kind: str, folder: Path, seed: int = 0):
    """Save a random model of `kind` (float32) to `folder`; returns the HF model."""
    import transformers as tf
    return save_random_model(tf.AutoModelForCausalLM, hf_config(kind), folder, seed)


def save_random_model(auto_class, config, folder: Path, seed: int = 0):
    """Build `config` with `auto_class` (float32), redraw its matrices from N(0, 0.08) (larger
    than transformers' init: decisive logits and routings, so greedy ties are rare), save it
    to `folder` as safetensors; returns the HF model."""
    torch.manual_seed(seed)
    model = auto_class.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def kv_bytes(hf, blocks: int, block_size: int = 16) -> int:
    """KV-cache bytes (float32) that hold exactly `blocks` blocks of the HF model `hf`:
    pass as `kv_cache_memory_bytes` to force preemption with few blocks."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return blocks * 2 * block_size * c.num_key_value_heads * head_dim * 4 * c.num_hidden_layers


def model_cache(tmp_path_factory, build: Callable) -> Callable[[str], tuple]:
    """kind -> (folder, build(kind, folder)), each kind built once into its own temporary folder."""
    cache: dict = {}

    def make(kind: str):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            cache[kind] = (folder, build(kind, folder))
        return cache[kind]
    return make
