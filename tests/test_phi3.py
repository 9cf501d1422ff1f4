"""Phi-3 (`Phi3ForCausalLM`) against transformers (float32, tiny random models saved with it).

- "phi3": fused qkv / gate_up checkpoint tensors, a 48-token sliding window: 24 greedy tokens
  equal transformers' plain, with chunked prefill and under forced preemption; logprobs within 1e-4.
- "phi3_longrope": longrope with original_max_position_embeddings = 32. Our tables pick the
  factors per position (polyrunner/ops/longrope.py); transformers picks one set per forward
  from its largest position. They agree when every position of a forward lies on one side of
  32: the table rows equal transformers' rotary output for positions all below / all at or
  above 32, and greedy decoding equals `generate` while every position stays below 32.
  Sequences that cross 32 (in decoding, where transformers' Phi-3 `generate` re-encodes the
  whole sequence with the long factors, or within the prompt) are compared with transformers'
  model whose rotary embedding makes the per-position choice out of its own short and long
  outputs (its unmodified logits differ, so the choice is tested).
- Tensor parallelism: each rank's fused rows are its q / k / v (gate / up) slices of the
  checkpoint's fused tensor (tensor_parallel_size=2 equals 1 end to end: "phi3" in
  tests/test_tensor_parallel.py, a slow module).
- Bad longrope fields raise errors naming the field.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_oracle import (
    ENGINE_VARIANTS,
    LOGPROB_VARIANTS,
    check_greedy_matches_hf,
    check_logprobs_match_hf,
    hf_greedy,
    random_prompts,
)
from polyrunner.models.arch import DecoderArch
from polyrunner.models.hf_config import ModelFileError
from polyrunner.ops.rotary import RotaryEmbedding

MAX_NEW = 24
ORIGINAL = 32   # phi3_longrope's original_max_position_embeddings


_HF_TOKENS: dict[tuple, list[int]] = {}   # transformers' greedy tokens, shared by the engine variants


def _check_greedy(folder, hf, prompts: list[list[int]], variant: str, oracle: str = "transformers") -> None:
    want = []
    for p in prompts:
        key = (id(hf), oracle, tuple(p))
        if key not in _HF_TOKENS:
            _HF_TOKENS[key] = hf_greedy(hf, p, MAX_NEW)
        want.append(_HF_TOKENS[key])
    check_greedy_matches_hf(folder, hf, variant, prompts, MAX_NEW, want=want, label=f"{oracle}: ")


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(tiny_model_factory, variant):
    folder, hf = tiny_model_factory("phi3")
    prompts = random_prompts()
    assert max(map(len, prompts)) + MAX_NEW > hf.config.sliding_window   # the window matters
    _check_greedy(folder, hf, prompts, variant)


@pytest.mark.parametrize("variant", list(LOGPROB_VARIANTS))
def test_logprobs_match_transformers(tiny_model_factory, variant):
    folder, hf = tiny_model_factory("phi3")
    check_logprobs_match_hf(folder, hf, variant)


# ---------------------------------------------------------------- longrope

def test_longrope_tables_match_transformers(tiny_model_factory):
    """Rows below 32 equal transformers' rotary output for positions all below 32 (short
    factors), rows from 32 on its output for positions all >= 32 (long factors); both scaled."""
    folder, hf = tiny_model_factory("phi3_longrope")
    arch = DecoderArch.from_hf_config(hf.config.to_dict())
    assert arch.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    ours = RotaryEmbedding(arch.head_dim, 128, arch.rope_theta, arch.rope_scaling)
    x = torch.zeros(1, dtype=torch.float32)
    for positions in (torch.arange(0, ORIGINAL), torch.arange(ORIGINAL, 128)):
        with torch.no_grad():
            cos, sin = hf.model.rotary_emb(x, positions[None])
        torch.testing.assert_close(ours.cos[positions], cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.sin[positions], sin[0], rtol=0, atol=1e-6)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(32)))
    # the two halves really differ: the long factors and the attention factor are in use
    plain = RotaryEmbedding(arch.head_dim, 128, arch.rope_theta, None)
    assert not torch.allclose(ours.cos[:ORIGINAL], plain.cos[:ORIGINAL], atol=1e-3)
    assert not torch.allclose(ours.cos[ORIGINAL:], plain.cos[ORIGINAL:], atol=1e-3)


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_longrope_below_original_matches_transformers(tiny_model_factory, variant):
    """Every position the model runs lies below 32: short factors in both."""
    folder, hf = tiny_model_factory("phi3_longrope")
    prompts = random_prompts(seed=3, max_len=10)
    assert max(map(len, prompts)) + MAX_NEW - 2 < ORIGINAL
    _check_greedy(folder, hf, prompts, variant)


def _per_position_rotary(rotary):
    """transformers' rotary `forward`, choosing short or long factors per position: its own
    output for the positions clamped below 32 (short) and clamped to >= 32 (long), merged."""
    forward = rotary.forward

    def per_position(x, position_ids):
        short = forward(x, position_ids.clamp(max=ORIGINAL - 1))
        long = forward(x, position_ids.clamp(min=ORIGINAL))
        below = (position_ids < ORIGINAL)[..., None]
        return tuple(torch.where(below, s, g) for s, g in zip(short, long))
    return per_position


# prompts below 32 whose decoding crosses it, and prompts that cross it themselves
CROSSING = [np.random.default_rng(4).integers(3, 512, size=n).tolist() for n in (12, 25, 31, 33, 40, 57)]


@pytest.fixture
def per_position_hf(tiny_model_factory, monkeypatch):
    """The phi3_longrope folder and its transformers model with the per-position choice.
    transformers' own choice differs: its logits for the prompts crossing 32 are checked to
    differ (and its `generate` re-encodes the whole sequence with the long factors once it
    outgrows 32)."""
    folder, hf = tiny_model_factory("phi3_longrope")
    rotary = hf.model.rotary_emb
    crossing = [p for p in CROSSING if len(p) > ORIGINAL]
    with torch.no_grad():
        plain = [hf(torch.tensor([p])).logits[0] for p in crossing]
        monkeypatch.setattr(rotary, "forward", _per_position_rotary(rotary))
        patched = [hf(torch.tensor([p])).logits[0] for p in crossing]
    for a, b in zip(plain, patched):
        assert (a - b).abs().max() > 1e-2 * b.abs().max()
    return folder, hf


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_longrope_crossing_matches_per_position_transformers(per_position_hf, variant):
    folder, hf = per_position_hf
    _check_greedy(folder, hf, CROSSING, variant, oracle="per-position")


def test_longrope_crossing_logprobs_match_per_position_transformers(per_position_hf):
    folder, hf = per_position_hf
    check_logprobs_match_hf(folder, hf, "chunked", CROSSING)   # chunks on both sides of 32


# ---------------------------------------------------------------- tensor parallelism

def test_fused_tensor_is_split_per_part_for_each_rank(tiny_model_factory):
    """Each rank's qkv_proj / gate_up_proj rows are its q, k, v (gate, up) slices of the
    checkpoint's fused tensor: rank 0 and rank 1 together hold every row exactly once."""
    from safetensors.torch import load_file

    from polyrunner.distributed.shard import TPShard
    from polyrunner.models.phi3 import Phi3ForCausalLM
    folder, hf = tiny_model_factory("phi3")
    arch = DecoderArch.from_hf_config(hf.config.to_dict())
    weights = load_file(str(folder / "model.safetensors"))
    qkv_name, gate_up_name = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"
    qkv, gate_up = weights[qkv_name], weights[gate_up_name]
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    inter = arch.intermediate_size
    hq, hkv, hi = q // 2, kv // 2, inter // 2
    for rank in (0, 1):
        model = Phi3ForCausalLM(arch, lambda *a: a[0], 64, TPShard.of(arch, rank, 2))
        model.load_weights(weights.items())
        layer = model.layers[0]
        heads = [qkv[rank * hq:(rank + 1) * hq], qkv[q + rank * hkv:q + (rank + 1) * hkv],
                 qkv[q + kv + rank * hkv:q + kv + (rank + 1) * hkv]]
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(heads))
        rows = [gate_up[rank * hi:(rank + 1) * hi], gate_up[inter + rank * hi:inter + (rank + 1) * hi]]
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(rows))


# ---------------------------------------------------------------- config validation

def _config(**rope_changes) -> dict:
    half = 8
    rope = dict(rope_type="longrope", short_factor=[1.0] * half, long_factor=[2.0] * half)
    rope.update(rope_changes)
    return dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=512, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                original_max_position_embeddings=32, rope_scaling={k: v for k, v in rope.items() if v is not None})


@pytest.mark.parametrize("changes, field, words", [
    (dict(short_factor=None), "rope_scaling.short_factor", "is missing"),
    (dict(long_factor=None), "rope_scaling.long_factor", "is missing"),
    (dict(short_factor=[1.0] * 7), "rope_scaling.short_factor", "head_dim // 2 = 8 entries, got 7"),
    (dict(long_factor=[1.0] * 16), "rope_scaling.long_factor", "head_dim // 2 = 8 entries, got 16"),
    (dict(long_factor=[1.0] * 7 + [0.0]), "rope_scaling.long_factor", "numbers > 0"),
    (dict(short_factor=[1.0] * 7 + ["x"]), "rope_scaling.short_factor", "a list of numbers"),
    (dict(short_factor=2.0), "rope_scaling.short_factor", "a list of numbers"),
    (dict(attention_factor=-1.0), "rope_scaling.attention_factor", "> 0"),
    (dict(rope_type="yarn"), "rope_scaling.rope_type", "'longrope'"),
    (dict(partial_rotary_factor=0.75), "rope_scaling.partial_rotary_factor", "must be 1.0"),
])
def test_bad_longrope_fields_name_the_field(changes, field, words):
    with pytest.raises(ModelFileError, match=words) as info:
        DecoderArch.from_hf_config(_config(**changes), "/m/config.json")
    assert info.value.field == field and f"'{field}'" in str(info.value) and "/m/config.json" in str(info.value)


def test_missing_original_length_and_partial_rotary_name_the_field():
    cfg = {**_config(), "model_type": "llama"}   # Phi-3's top level defaults to 4096, as in transformers
    del cfg["original_max_position_embeddings"]
    with pytest.raises(ModelFileError, match="original_max_position_embeddings' is missing") as info:
        DecoderArch.from_hf_config(cfg)
    assert info.value.field == "original_max_position_embeddings"
    with pytest.raises(ModelFileError, match="must be 1.0") as info:
        DecoderArch.from_hf_config({**_config(), "partial_rotary_factor": 0.5})
    assert info.value.field == "partial_rotary_factor"


@pytest.mark.parametrize("rope_changes, top", [
    ({}, {}),                                                           # factor from the lengths
    (dict(type="su", rope_type=None), {}),                              # the older name
    (dict(factor=2.0), {}),                                             # the given factor
    (dict(attention_factor=1.3), {}),                                   # the given attention factor
    (dict(original_max_position_embeddings=64), {}),                    # the top-level length wins
    (dict(original_max_position_embeddings=64), dict(original_max_position_embeddings=None)),  # Phi-3: 4096
    (dict(original_max_position_embeddings=64), dict(original_max_position_embeddings=None, model_type="llama",
                                                    architectures=["LlamaForCausalLM"])),  # the rope's own
    ({}, dict(max_position_embeddings=16)),                             # factor < 1: no scaling
])
def test_longrope_settings_resolve_as_transformers(rope_changes, top):
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = {**_config(**rope_changes), **top}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    arch = DecoderArch.from_hf_config(cfg)
    # transformers 5.24 renames "su" after moving the top-level length into the rope settings, then
    # misses it: its side gets the name "su" stands for
    rope = {("rope_type" if k == "type" else k): ("longrope" if v == "su" else v)
            for k, v in cfg["rope_scaling"].items()}
    hf = tf.AutoConfig.for_model(**{**cfg, "rope_scaling": rope})
    inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](hf)
    assert arch.rope_scaling["rope_type"] == hf.rope_parameters["rope_type"] == "longrope"
    assert arch.rope_scaling["original_max_position_embeddings"] == hf.rope_parameters[
        "original_max_position_embeddings"]
    assert arch.rope_scaling["attention_factor"] == pytest.approx(attention, rel=1e-12)
    ours = RotaryEmbedding(arch.head_dim, 8, arch.rope_theta, arch.rope_scaling)
    freqs = torch.arange(8, dtype=torch.float32)[:, None] * inv_freq
    torch.testing.assert_close(ours.cos, torch.cat((freqs, freqs), -1).cos() * attention, rtol=0, atol=1e-6)
