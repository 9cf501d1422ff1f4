"""Random Llama checkpoints of a chosen size for the memory and start-up tests: a bfloat16
Hugging Face folder (`write_bf16_llama`) and a GGUF file of block-quantized matrices
(`write_gguf_llama`), neither with a tokenizer (prompts go in as token ids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from gguf_header import decoder_writer
from polyrunner.tools.conformance.tiny_llama import write_tiny_llama
from quant_blocks import scaled_blocks

# (hidden, intermediate, layers, heads, kv_heads, vocab)
SMALL = (256, 512, 2, 4, 2, 512)
LARGE = (1024, 2816, 8, 16, 4, 32000)   # ~122M parameters: 245 MB in bfloat16
LARGE_GGUF = (1536, 4096, 12, 12, 4, 32000)   # ~351M parameters: 373 MB in Q8_0, 288 MB in Q6_K, 197 MB in Q4_K


def write_bf16_llama(folder: Path, size: tuple[int, ...]) -> Path:
    """A random bfloat16 Llama of `size` (see `LARGE`) with tied embeddings; returns its folder."""
    hidden, inter, layers, heads, kv_heads, vocab = size
    return write_tiny_llama(folder, dtype="bfloat16", std=0.02, hidden_size=hidden, intermediate_size=inter,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=1024)


def write_gguf_llama(path: Path, size: tuple[int, ...], qtype: str, v_qtype: str | None = None,
                     seed: int = 0) -> Path:
    """A random Llama GGUF of `size` whose matrices (the tied embedding too) are `qtype` blocks
    for weights of standard deviation ~0.02 (`attn_v` in `v_qtype` where given: a fused qkv of two
    types, as llama.cpp's Q4_K_M files have); norms in F32."""
    hidden, inter, layers, heads, kv_heads, vocab = size
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    w = decoder_writer(path, "llama", hidden=hidden, inter=inter, layers=layers, heads=heads, kv_heads=kv_heads,
                       context=1024, name="memory-test-model")
    w.add_vocab_size(vocab)

    def matrix(name: str, rows: int, cols: int, kind: str = qtype) -> None:
        blocks = scaled_blocks(rng, kind, rows, cols, 0.02)
        w.add_tensor(name, blocks, raw_dtype=Q[kind])

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.05 * rng.standard_normal(hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        matrix(p + "attn_q.weight", heads * head_dim, hidden)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden, v_qtype or qtype)
        matrix(p + "attn_output.weight", hidden, heads * head_dim)
        norm(p + "ffn_norm.weight")
        matrix(p + "ffn_gate.weight", inter, hidden)
        matrix(p + "ffn_up.weight", inter, hidden)
        matrix(p + "ffn_down.weight", hidden, inter)
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
