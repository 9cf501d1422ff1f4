"""The shapes of the real models the benchmarks imitate with random weights (benchmarks/realistic_models.py
writes them): each one's config.json shape fields, where they were read, and its tensors in HF order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Shape:
    """A real model's shape: `config` holds config.json's shape fields, `source` where they were read."""
    name: str
    config: dict[str, Any]
    source: str
    tokenizer_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        c = self.config
        return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor of the HF checkpoint, in file order."""
        c = self.config
        h, inter, hd = c["hidden_size"], c["intermediate_size"], self.head_dim
        q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            out += [(p + "input_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                    (p + "post_attention_layernorm.weight", (h,)),
                    (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                    (p + "mlp.down_proj.weight", (h, inter))]
        out.append(("model.norm.weight", (h,)))
        if not c["tie_word_embeddings"]:
            out.append(("lm_head.weight", (c["vocab_size"], h)))
        return out

    def num_params(self) -> int:
        return sum(numel(s) for _, s in self.tensors())

    def embedding_params(self) -> int:
        return self.config["vocab_size"] * self.config["hidden_size"]


def numel(shape: tuple[int, ...]) -> int:
    """The number of elements of a tensor of `shape`."""
    n = 1
    for d in shape:
        n *= d
    return n


_LLAMA3 = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
               attention_bias=False, mlp_bias=False, initializer_range=0.02, max_position_embeddings=131072,
               rope_theta=500000.0, vocab_size=128256)
_VOCAB_NOTE = ("real vocabulary size 128256 kept; the tokenizer (SmolLM2's, 49152 tokens) is padded with "
               "79104 unused [PAD<i>] tokens by convert_hf_to_gguf.py")

SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("smollm2-1.7b", dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
        attention_bias=False, mlp_bias=False, initializer_range=0.02, hidden_size=2048, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=32, head_dim=64, intermediate_size=8192, vocab_size=49152,
        tie_word_embeddings=True, rope_theta=130000.0, rope_scaling=None, max_position_embeddings=8192),
        "HuggingFaceTB/SmolLM2-1.7B-Instruct config.json (huggingface.co/HuggingFaceTB/SmolLM2-1.7B-Instruct/"
        "blob/dfc017ec3d4e0eaed394f8bf2a0fd2ff24f8b2cd/config.json)",
        "the model's own tokenizer family (SmolLM2, 49152 tokens)"),
    Shape("llama-3.2-3b", dict(
        _LLAMA3, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, intermediate_size=8192, tie_word_embeddings=True,
        rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3")),
        "meta-llama/Llama-3.2-3B-Instruct config.json (gated; copies with _name_or_path "
        "meta-llama/Llama-3.2-3B-Instruct: huggingface.co/lunahr/thea-c-3b-25r/blame/63c6400/config.json, "
        "huggingface.co/datasets/lhpku20010120/Llama-3.2-3B-Instruct/blob/main/config.json)", _VOCAB_NOTE),
    Shape("llama-3.1-8b", dict(
        _LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
        rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3")),
        "meta-llama/Llama-3.1-8B config.json (gated; copies: huggingface.co/mlx-community/Meta-Llama-3.1-8B-bf16/"
        "blob/refs%2Fpr%2F1/config.json, huggingface.co/NbAiLab/nb-llama-3.1-8B/blob/main/config.json "
        "(_name_or_path meta-llama/Llama-3.1-8B))", _VOCAB_NOTE),
    # not a real model: a few layers of the 8B's kind (untied, llama3 rope, padded vocabulary) for smoke runs
    Shape("smoke-tiny", dict(
        _LLAMA3, hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1536, tie_word_embeddings=False,
        rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3")),
        "none (a smoke-test shape of this script)", _VOCAB_NOTE),
)}
REAL_SHAPES = ("smollm2-1.7b", "llama-3.2-3b", "llama-3.1-8b")
