"""Tiny random mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) saved with transformers."""

from __future__ import annotations

from tiny_models import save_random_model

COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)


def moe_config(kind: str):
    """A tiny config of `kind`: 4-8 experts, top-2, expert width 32 (all even: two ranks split them)."""
    import transformers as tf
    if kind == "mixtral":
        return tf.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=32, num_local_experts=4,
                                num_experts_per_tok=2)
    if kind == "qwen2_moe":   # layer 1 dense; a shared expert; top-k weights not renormalised
        return tf.Qwen2MoeConfig(**COMMON, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                 mlp_only_layers=[1], norm_topk_prob=False)
    if kind == "qwen3_moe":   # layers 1 and 3 sparse (decoder_sparse_step 2), q/k norms, renormalised
        return tf.Qwen3MoeConfig(**COMMON, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
                                 num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True,
                                 head_dim=32)
    raise ValueError(kind)


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


def build_moe_model(kind: str, folder, seed: int = 0):
    """Save a random float32 model of `kind` to `folder`; returns the HF model."""
    import transformers as tf
    return save_random_model(tf.AutoModelForCausalLM, moe_config(kind), folder, seed)
