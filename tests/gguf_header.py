"""The metadata every random decoder GGUF file of the tests starts with (test_gguf.py, memory_models.py,
quant_moe_gguf.py): sizes, heads, RMS-norm epsilon and rotary base."""

from __future__ import annotations

from pathlib import Path

import gguf


def decoder_writer(path: Path, arch: str, *, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
                   context: int, rope_theta: float = 10000.0, name: str | None = None) -> gguf.GGUFWriter:
    """A `GGUFWriter` for `path` with a decoder's header written (a "llama" file also gets its rotary
    dimension, hidden / heads); the caller adds the tokenizer and tensors and writes the file."""
    w = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_theta)
    if arch == "llama":
        w.add_rope_dimension_count(hidden // heads)
    return w
