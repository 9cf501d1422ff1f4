"""Mixture-of-experts GGUF files (llama.cpp's layout) load in polyrunner.

Each file is written here with gguf's `GGUFWriter` from a tiny random transformers model
(`moe_tiny_models`) the way llama.cpp's convert_hf_to_gguf.py stores it: Mixtral as
architecture "llama" with `llama.expert_count`, q/k rows permuted; Qwen2-MoE ("qwen2moe",
shared expert, a dense layer) and Qwen3-MoE ("qwen3moe", dense layers); a layer's experts
stacked in one 3-D tensor per projection (`ffn_gate_exps` / `ffn_up_exps` `[E, I, H]`,
`ffn_down_exps` `[E, H, I]`, PyTorch order), matrices quantized to Q8_0 with
`gguf.quants.quantize` (the router and rows that Q8_0 cannot hold stay F32).

The oracle is transformers on the dequantised model: the same Q8_0 values decoded with
`gguf.quants.dequantize`, saved as a Hugging Face folder. Polyrunner on the GGUF file in
float32 (experts read dequantised) gives transformers' greedy tokens (24 new) and logprobs;
run quantized on the CPU (attention and LM head through the Q8_0 kernels, the embedding
looked up in its blocks, the 3-D expert stacks kept in their Q8_0 blocks through the "moe"
role's quantized override, never as linears) its tokens equal up to a near-tie of the float32
reference, as tests/test_cpu_quant_model.py accepts.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from hf_oracle import hf_greedy, hf_logprobs  # noqa: E402
from moe_tiny_models import build_moe_model  # noqa: E402
from polyrunner import LLM, SamplingParams  # noqa: E402
from polyrunner.backends.cpu import quant_linear as ql  # noqa: E402
from polyrunner.backends.cpu.moe_module import QuantFusedMoE  # noqa: E402
from polyrunner.backends.cpu.quant_embedding import QuantEmbedding  # noqa: E402
from polyrunner.models.arch import DecoderArch  # noqa: E402
from polyrunner.models.gguf import cache as gguf_cache  # noqa: E402
from polyrunner.models.gguf import tensors as gguf_tensors  # noqa: E402
from polyrunner.models.gguf.loader import QUANTIZED_FILE, GGUFError, convert_gguf  # noqa: E402
from polyrunner.ops import FusedMoE  # noqa: E402
from test_gguf import _llamacpp_permute  # noqa: E402

KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
MAX_NEW = 24
TOL = 1e-4
NEAR_TIE = 0.25   # nats, as tests/test_cpu_quant_model.py
PROMPTS = [np.random.default_rng(s).integers(3, 512, size=n).tolist() for s, n in enumerate([5, 17, 33, 58, 9, 41])]


# ------------------------------------------------------------------ writing llama.cpp's layout


def _q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Q8_0 bytes, their dequantised float32 values) of x, quantized along its last dimension."""
    data = gguf.quants.quantize(x, Q.Q8_0)
    return data, gguf.quants.dequantize(data, Q.Q8_0).astype(np.float32).reshape(x.shape)


def write_moe_gguf(path: Path, src: Path, kind: str, edit=None) -> dict[str, torch.Tensor]:
    """Write the transformers model saved in `src` as a llama.cpp MoE GGUF at `path`; returns
    the dequantised weights under their Hugging Face (per-expert) names. `edit(name, array)`
    may replace a GGUF tensor before it is written, or drop it (None) (error tests)."""
    cfg = json.loads((src / "config.json").read_text())
    hf = load_file(src / "model.safetensors")
    arch, mixtral = GGUF_ARCH[kind], kind == "mixtral"
    heads, kv_heads, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(theta)
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if mixtral:
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    ref: dict[str, torch.Tensor] = {}

    def add(name: str, x: np.ndarray, hf_names: list[str], permute: int = 0, quantize: bool = True) -> None:
        """GGUF tensor `name` from x (PyTorch order); its decoded value is the reference of
        `hf_names` (one name, or one per expert of a stack)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if edit is not None:
            x = edit(name, x)
            if x is None:
                return
        if quantize and x.ndim > 1 and x.shape[-1] % 32 == 0:
            data, value = _q8_0(x)   # per row: a row permutation commutes with it
            w.add_tensor(name, _llamacpp_permute(data, permute) if permute else data, raw_dtype=Q.Q8_0)
        else:
            value = x
            w.add_tensor(name, _llamacpp_permute(x, permute) if permute else x)
        for i, hf_name in enumerate(hf_names):
            ref[hf_name] = torch.from_numpy(np.ascontiguousarray(value[i] if len(hf_names) > 1 else value))

    def take(hf_name: str) -> np.ndarray:
        return hf[hf_name].float().numpy()

    add("token_embd.weight", take("model.embed_tokens.weight"), ["model.embed_tokens.weight"])
    add("output_norm.weight", take("model.norm.weight"), ["model.norm.weight"])
    add("output.weight", take("lm_head.weight"), ["lm_head.weight"])
    block, parts = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else \
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
    for i in range(cfg["num_hidden_layers"]):
        p, m = f"blk.{i}.", f"model.layers.{i}."
        for gg, hn in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                       ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                       ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")):
            if f"{m}{hn}.weight" in hf:
                add(f"{p}{gg}.weight", take(f"{m}{hn}.weight"), [f"{m}{hn}.weight"])
        for gg, hn, n in (("attn_q", "q_proj", heads), ("attn_k", "k_proj", kv_heads)):
            for suffix in ("weight", "bias"):
                if f"{m}self_attn.{hn}.{suffix}" in hf:
                    add(f"{p}{gg}.{suffix}", take(f"{m}self_attn.{hn}.{suffix}"), [f"{m}self_attn.{hn}.{suffix}"],
                        permute=n if mixtral else 0)
        if kind == "qwen2_moe":
            for suffix in ("bias",):
                add(f"{p}attn_v.{suffix}", take(f"{m}self_attn.v_proj.{suffix}"), [f"{m}self_attn.v_proj.{suffix}"])
        if f"{m}{block}.gate.weight" not in hf:   # a dense layer
            for gg, hn in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                add(f"{p}{gg}.weight", take(f"{m}mlp.{hn}.weight"), [f"{m}mlp.{hn}.weight"])
            continue
        add(f"{p}ffn_gate_inp.weight", take(f"{m}{block}.gate.weight"), [f"{m}{block}.gate.weight"], quantize=False)
        for gg, part in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), parts):
            names = [f"{m}{block}.experts.{e}.{part}.weight" for e in range(experts)]
            add(f"{p}{gg}.weight", np.stack([take(n) for n in names]), names)
        if kind == "qwen2_moe":
            for gg, hn in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"),
                           ("ffn_down_shexp", "down_proj")):
                name = f"{m}mlp.shared_expert.{hn}.weight"
                add(f"{p}{gg}.weight", take(name), [name])
            gate = take(f"{m}mlp.shared_expert_gate.weight")   # [1, H]: llama.cpp's {n_embd}, 1-D
            add(f"{p}ffn_gate_inp_shexp.weight", gate.reshape(-1), [f"{m}mlp.shared_expert_gate.weight"],
                quantize=False)
            ref[f"{m}mlp.shared_expert_gate.weight"] = ref[f"{m}mlp.shared_expert_gate.weight"].reshape(1, -1)
    assert edit is not None or set(ref) == set(hf), set(hf) ^ set(ref)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """kind -> (GGUF file, its converted folder, transformers on the dequantised weights, its greedy tokens)."""
    cache: dict = {}

    def make(kind: str):
        if kind not in cache:
            base = tmp_path_factory.mktemp(f"gguf-{kind}")
            build_moe_model(kind, base / "src")
            ref = write_moe_gguf(base / "m.gguf", base / "src", kind)
            (base / "ref").mkdir()
            shutil.copy(base / "src" / "config.json", base / "ref" / "config.json")
            save_file(ref, base / "ref" / "model.safetensors", metadata={"format": "pt"})
            from transformers import AutoModelForCausalLM
            hf = AutoModelForCausalLM.from_pretrained(base / "ref", dtype=torch.float32).eval()
            greedy = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
            cache[kind] = (base / "m.gguf", convert_gguf(base / "m.gguf", base / "out"), hf, greedy)
        return cache[kind]
    return make


def _run(model: str, **options) -> tuple[LLM, list]:
    llm = LLM(model, backend="cpu", max_num_seqs=8, max_model_len=128, **options)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    return llm, [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                     use_tqdm=False)]


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("kind", KINDS)
def test_the_config_describes_the_same_mixture_of_experts(moe_gguf, kind):
    _, folder, hf, _ = moe_gguf(kind)
    converted = json.loads((folder / "config.json").read_text())
    assert converted["architectures"] == hf.config.architectures
    mine, theirs = DecoderArch.from_hf_config(converted), DecoderArch.from_hf_config(hf.config.to_dict())
    assert mine.moe == theirs.moe and mine.moe is not None
    assert (mine.qkv_bias, mine.qk_norm, mine.head_dim, mine.num_kv_heads) == \
        (theirs.qkv_bias, theirs.qk_norm, theirs.head_dim, theirs.num_kv_heads)


@pytest.mark.parametrize("kind", KINDS)
def test_expert_stacks_are_indexed_whole_and_never_as_quantized_linears(moe_gguf, kind):
    """One index entry per stacked projection ([E, rows, cols], Q8_0), no per-expert entry;
    gguf_quantized.json (what quantized execution swaps linears for) holds 2-D matrices only."""
    _, folder, hf, _ = moe_gguf(kind)
    tensors = gguf_tensors.read_index(folder)["tensors"]
    block, gate, down = ("block_sparse_moe", "w1", "w2") if kind == "mixtral" else ("mlp", "gate_proj", "down_proj")
    layer = 1 if kind == "qwen3_moe" else 0
    experts = len(hf.model.layers[layer].mlp.experts.gate_up_proj)
    inter = hf.model.layers[layer].mlp.experts.down_proj.shape[-1]
    stacked = tensors[f"model.layers.{layer}.{block}.experts.{gate}.weight"]
    assert (stacked["type"], stacked["shape"]) == ("Q8_0", [experts, inter, 64])
    assert tensors[f"model.layers.{layer}.{block}.experts.{down}.weight"]["shape"] == [experts, 64, inter]
    assert not [n for n in tensors if ".experts.0." in n]
    quantized = json.loads((folder / QUANTIZED_FILE).read_text())["tensors"]
    assert quantized and all(len(t["shape"]) == 2 for t in quantized.values())
    assert not [n for n in quantized if ".experts." in n]


@pytest.mark.parametrize("kind", KINDS)
def test_float32_greedy_and_logprobs_equal_transformers_on_the_dequantised_model(moe_gguf, kind, tmp_path,
                                                                                 monkeypatch):
    """Also through the dense float32 copy the first run keeps (stacked names, read back)."""
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "gguf")
    path, _, hf, want = moe_gguf(kind)
    llm, outs = _run(str(path), dtype="float32")
    assert llm.engine.quantization is None
    assert len(list((tmp_path / "gguf").glob("*/model.float32.safetensors"))) == 1
    assert [o.token_ids for o in _run(str(path), dtype="float32")[1]] == [o.token_ids for o in outs]
    for p, out, ref in zip(PROMPTS, outs, want):
        assert out.token_ids == ref, f"{kind} prompt len {len(p)}"
        lp = hf_logprobs(hf, p + out.token_ids)
        for i, entry in enumerate(out.logprobs):
            for tid, e in entry.items():
                assert abs(e.logprob - float(lp[len(p) - 1 + i, tid])) <= TOL, f"{kind}: token {i}, id {tid}"


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_cpu_run_equals_the_dequantised_model_up_to_near_ties(moe_gguf, kind, tmp_path, monkeypatch):
    """The default run of a .gguf on the CPU: attention, the LM head and every sparse layer's
    experts through the Q8_0 kernels (no dense expert parameter left), the embedding looked up in
    its blocks. Every step goes through the integer kernels (`PREFILL_ROWS` tokens at most). A
    prompt's tokens equal the reference's until the first difference, which must be where the
    reference's top two are within NEAR_TIE."""
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "gguf")
    path, _, hf, want = moe_gguf(kind)
    llm, outs = _run(str(path), dtype="float32", quantization="gguf", max_num_batched_tokens=ql.PREFILL_ROWS)
    model = llm.engine.runner.model
    swapped = [m for m in model.modules() if isinstance(m, ql.QuantLinear)]
    assert len(swapped) >= 2 * len(model.layers)   # qkv + o per layer at least
    sparse = sum(llm.engine.arch.moe.sparse_layers)
    moe = [m for m in model.modules() if isinstance(m, QuantFusedMoE)]
    assert len(moe) == sparse and all(m.qtypes == ("Q8_0", "Q8_0") for m in moe)
    assert not [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.lm_head is model.quantized_lm_head
    early = 0
    for p, out, ref in zip(PROMPTS, outs, want):
        got = out.token_ids
        assert len(got) == MAX_NEW
        i = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if i is None:
            continue
        lp = hf_logprobs(hf, p + ref)[len(p) - 1 + i]
        gap = float(lp[ref[i]] - lp[got[i]])
        assert gap < NEAR_TIE, f"{kind} prompt len {len(p)}: token {i} is {got[i]}, float32 gave {ref[i]} by {gap:.3f}"
        early += 1
    assert early <= len(PROMPTS) // 2


@pytest.mark.parametrize("tensor,shape", [("blk.1.ffn_down_exps.weight", "[4, 32, 64]"),
                                          ("blk.0.ffn_gate_inp.weight", "[3, 64]")])
def test_an_expert_tensor_of_the_wrong_shape_is_named(moe_gguf, tmp_path, tensor, shape):
    src = moe_gguf("mixtral")[0].parent / "src"

    def edit(name: str, x: np.ndarray) -> np.ndarray:
        if name != tensor:
            return x
        return x.swapaxes(1, 2).copy() if x.ndim == 3 else x[:3].copy()   # down as [E, I, H]; one expert short

    write_moe_gguf(tmp_path / "bad.gguf", src, "mixtral", edit=edit)
    with pytest.raises(GGUFError, match=rf"bad\.gguf: tensor '{re.escape(tensor)}' has shape {re.escape(shape)} "
                                        r"\(PyTorch order\), expected \[.*\] \(expert_count 4"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out" / gguf_tensors.TENSORS_FILE).exists()


def test_a_missing_expert_stack_is_named(moe_gguf, tmp_path):
    src = moe_gguf("qwen3_moe")[0].parent / "src"
    write_moe_gguf(tmp_path / "gap.gguf", src, "qwen3_moe",
                   edit=lambda name, x: None if name == "blk.3.ffn_up_exps.weight" else x)
    with pytest.raises(GGUFError, match=r"gap\.gguf: the file has no tensor 'blk\.3\.ffn_up_exps\.weight'"):
        convert_gguf(tmp_path / "gap.gguf", tmp_path / "out")


def test_a_stacked_tensor_with_the_wrong_expert_count_is_named(moe_gguf):
    """The model side: a stack of the wrong length is refused by `load_weights`, naming it."""
    _, folder, _, _ = moe_gguf("mixtral")
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=2, max_model_len=64)
    model = llm.engine.runner.model
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.block_sparse_moe\.experts\.w1\.weight' has shape "
                                         r"\(3, 32, 64\), expected \[4 experts"):
        model.load_weights([("model.layers.0.block_sparse_moe.experts.w1.weight", torch.zeros(3, 32, 64))])
