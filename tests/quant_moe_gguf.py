"""Random Mixtral-shaped GGUF files whose matrices and 3-D expert stacks are block-quantized, as
llama.cpp lays them out (architecture "llama" with `llama.expert_count`; `ffn_gate_exps` /
`ffn_up_exps` `[E, I, H]`, `ffn_down_exps` `[E, H, I]` in PyTorch order; the router
`ffn_gate_inp` and the norms F32; no tokenizer: prompts are token ids).

Blocks are random and valid (`quant_blocks.centered_blocks`), their float16 scales set for
weights of standard deviation `weight_std` (measured on a few rows per tensor), so a run's logits
are those of a plausible small model. `Q4_K_M` is llama.cpp's mix for that file type: Q4_K
matrices, attention v, the experts' down stacks of every other layer and the LM head Q6_K.
Used by tests/test_cpu_quant_moe.py and benchmarks/moe.py (a larger shape).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from gguf_header import decoder_writer
from quant_blocks import scaled_blocks

Q4_K_M = {"attn": "Q4_K", "attn_v": "Q6_K", "gate_up": "Q4_K", "down": "Q4_K", "down_more_bits": "Q6_K",
          "embed": "Q4_K", "output": "Q6_K"}


@dataclass(frozen=True)
class MoEShape:
    """A Mixtral's sizes (K-quants need hidden and intermediate multiples of 256)."""

    vocab: int = 512
    hidden: int = 256
    intermediate: int = 256
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    heads: int = 4
    kv_heads: int = 2
    context: int = 512
    types: dict[str, str] = field(default_factory=lambda: dict(Q4_K_M))   # part -> GGML type ("output": None, tied)


def write_quant_moe_gguf(path: Path, shape: MoEShape = MoEShape(), seed: int = 0, weight_std: float = 0.08,
                         head_std: float = 0.08) -> Path:
    """Write the random model of `shape` to `path` (the part types of `shape.types`); returns `path`.
    `head_std`: the LM head's weights' (larger: sharper next-token distributions, fewer near-ties)."""
    rng = np.random.default_rng(seed)
    s, t = shape, shape.types
    head_dim = s.hidden // s.heads
    w = decoder_writer(path, "llama", hidden=s.hidden, inter=s.intermediate, layers=s.layers, heads=s.heads,
                       kv_heads=s.kv_heads, context=s.context)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)

    def add(name: str, qtype: str, *dims: int, std: float = weight_std) -> None:
        rows = int(np.prod(dims[:-1]))
        data = scaled_blocks(rng, qtype, rows, dims[-1], std)
        w.add_tensor(name, data.reshape(*dims[:-1], -1), raw_dtype=None if qtype == "F32" else Q[qtype])

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(s.hidden)).astype(np.float32))

    add("token_embd.weight", t["embed"], s.vocab, s.hidden)
    for i in range(s.layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        add(p + "attn_q.weight", t["attn"], s.heads * head_dim, s.hidden)
        add(p + "attn_k.weight", t["attn"], s.kv_heads * head_dim, s.hidden)
        add(p + "attn_v.weight", t.get("attn_v", t["attn"]), s.kv_heads * head_dim, s.hidden)
        add(p + "attn_output.weight", t["attn"], s.hidden, s.heads * head_dim)
        norm(p + "ffn_norm.weight")
        add(p + "ffn_gate_inp.weight", "F32", s.experts, s.hidden)
        add(p + "ffn_gate_exps.weight", t["gate_up"], s.experts, s.intermediate, s.hidden)
        add(p + "ffn_up_exps.weight", t["gate_up"], s.experts, s.intermediate, s.hidden)
        down = t.get("down_more_bits", t["down"]) if i % 2 == 0 else t["down"]
        add(p + "ffn_down_exps.weight", down, s.experts, s.hidden, s.intermediate)
    norm("output_norm.weight")
    if t.get("output") is not None:
        add("output.weight", t["output"], s.vocab, s.hidden, std=head_std)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
