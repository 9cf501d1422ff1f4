"""Mixtral, Qwen2-MoE and Qwen3-MoE equal Hugging Face transformers (float32, tiny random models
saved with transformers): the greedy tokens of 24 new tokens and every reported logprob (sampled
and prompt, within 1e-4), plain, with chunked prefill and under forced preemption. The Qwen
models mix sparse and dense layers (`mlp_only_layers`, `decoder_sparse_step`); Qwen2-MoE has a
shared expert. Also: what transformers saves is the hub's per-expert layout, which is what the
loader reads; a missing expert tensor is named; bad MoE config fields name the field and range."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from hf_oracle import ENGINE_VARIANTS, check_greedy_matches_hf, hf_greedy, hf_logprobs, random_prompts
from moe_tiny_models import KINDS, build_moe_model
from polyrunner import LLM
from polyrunner.distributed.shard import TPShard
from polyrunner.models.arch import DecoderArch
from polyrunner.models.hf_config import ModelFileError
from tiny_models import model_cache

TOL = 1e-4
MAX_NEW = 24


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return model_cache(tmp_path_factory, build_moe_model)


PROMPTS = random_prompts()


@pytest.fixture(scope="module")
def hf_greedy_tokens(moe_model):
    cache: dict = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            hf = moe_model(kind)[1]
            cache[kind] = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
        return cache[kind]
    return get


def _check_logprobs(hf, out, where: str) -> None:
    """Every reported logprob (the sampled tokens' top 5 + the chosen one, the prompt's top 3)
    equals log_softmax of transformers' logits over prompt + completion."""
    prompt, comp = out.prompt_token_ids, out.outputs[0]
    lp = hf_logprobs(hf, prompt + comp.token_ids)
    assert len(comp.logprobs) == MAX_NEW and out.prompt_logprobs[0] is None
    for i, entry in enumerate(comp.logprobs):
        assert comp.token_ids[i] in entry and len(entry) >= 5
        for tid, e in entry.items():
            assert abs(e.logprob - float(lp[len(prompt) - 1 + i, tid])) <= TOL, f"{where}: token {i}, id {tid}"
    for j, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert prompt[j] in entry
        for tid, e in entry.items():
            assert abs(e.logprob - float(lp[j - 1, tid])) <= TOL, f"{where}: prompt position {j}, id {tid}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_and_logprobs_match_transformers(moe_model, hf_greedy_tokens, kind, variant):
    folder, hf = moe_model(kind)
    outs = check_greedy_matches_hf(folder, hf, variant, PROMPTS, MAX_NEW, want=hf_greedy_tokens(kind),
                                   label=f"{kind}/", sampling=dict(logprobs=5, prompt_logprobs=3))
    for p, out in zip(PROMPTS, outs):
        _check_logprobs(hf, out, f"{kind}/{variant} prompt len {len(p)}")


@pytest.mark.parametrize("kind", KINDS)
def test_the_layers_are_sparse_where_the_config_says(moe_model, kind):
    folder, hf = moe_model(kind)
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=2, max_model_len=64)
    sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in llm.engine.runner.model.layers]
    assert sparse == {"mixtral": [True, True], "qwen2_moe": [True, False, True],
                      "qwen3_moe": [False, True, False, True]}[kind]
    assert sparse == [not hasattr(layer.mlp, "down_proj") for layer in hf.model.layers]
    layers = llm.engine.runner.model.layers
    shared = [layer.mlp.shared_expert is not None for layer, is_sparse in zip(layers, sparse) if is_sparse]
    assert all(shared) == (kind == "qwen2_moe")


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_saves_the_per_expert_layout_the_loader_reads(moe_model, kind):
    """transformers 5.24 keeps its experts as 3-D `gate_up_proj` / `down_proj` in memory but saves
    the hub's per-expert tensors (its conversion mapping reverted): the layout real checkpoints
    hold, which the parity tests above load."""
    folder, hf = moe_model(kind)
    names = set(load_file(folder / "model.safetensors"))
    block, gate = ("block_sparse_moe", "w1") if kind == "mixtral" else ("mlp", "gate_proj")
    sparse_layer = 1 if kind == "qwen3_moe" else 0
    experts = hf.config.num_local_experts if kind == "mixtral" else hf.config.num_experts
    assert {f"model.layers.{sparse_layer}.{block}.experts.{e}.{gate}.weight" for e in range(experts)} <= names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name, _ in hf.named_parameters())


def test_a_missing_expert_tensor_is_named(moe_model, tmp_path):
    folder, _ = moe_model("mixtral")
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint is missing weights: layers\.1\.mlp\.experts\.w13_weight"):
        LLM(str(tmp_path), backend="cpu", dtype="float32", max_num_seqs=2, max_model_len=64)


def _config(moe_model, kind: str) -> dict:
    return json.loads((moe_model(kind)[0] / "config.json").read_text())


@pytest.mark.parametrize("kind,count_field", [("mixtral", "num_local_experts"), ("qwen2_moe", "num_experts")])
@pytest.mark.parametrize("k", [0, 9, -1])
def test_a_bad_num_experts_per_tok_names_the_field_and_range(moe_model, kind, count_field, k):
    cfg = _config(moe_model, kind)
    experts = cfg[count_field]
    with pytest.raises(ModelFileError, match=rf"config field 'num_experts_per_tok' must be an integer in "
                                             rf"\[1, {experts}\] \(1 to {count_field}\), got {k}") as err:
        DecoderArch.from_hf_config({**cfg, "num_experts_per_tok": k})
    assert err.value.field == "num_experts_per_tok"


def test_other_bad_moe_fields_name_the_field(moe_model):
    cfg = _config(moe_model, "qwen2_moe")
    with pytest.raises(ModelFileError, match=r"config field 'num_experts' is missing"):
        DecoderArch.from_hf_config({k: v for k, v in cfg.items() if k != "num_experts"})
    with pytest.raises(ModelFileError, match=r"config field 'moe_intermediate_size' is missing"):
        DecoderArch.from_hf_config({k: v for k, v in cfg.items() if k != "moe_intermediate_size"})
    with pytest.raises(ModelFileError, match=r"config field 'mlp_only_layers' entries must be layer indices in "
                                             r"\[0, 2\], got 3"):
        DecoderArch.from_hf_config({**cfg, "mlp_only_layers": [1, 3]})
    with pytest.raises(ModelFileError, match=r"config field 'decoder_sparse_step' must be an integer >= 1"):
        DecoderArch.from_hf_config({**cfg, "decoder_sparse_step": 0})
    with pytest.raises(ModelFileError, match=r"config field 'num_experts' must be an integer >= 1"):
        DecoderArch.from_hf_config({**cfg, "num_experts": 0})


def test_the_arch_carries_the_moe_facts(moe_model):
    mixtral = DecoderArch.from_hf_config(_config(moe_model, "mixtral")).moe
    assert mixtral is not None and (mixtral.num_experts, mixtral.top_k, mixtral.intermediate) == (4, 2, 32)
    assert mixtral.renormalize and mixtral.shared_expert_intermediate == 0
    q2 = DecoderArch.from_hf_config(_config(moe_model, "qwen2_moe"))
    assert q2.qkv_bias and not q2.qk_norm and q2.sliding_windows == (None,) * 3   # saved sliding_window 0: none
    assert q2.moe is not None and q2.moe.sparse_layers == (True, False, True)
    assert (q2.moe.shared_expert_intermediate, q2.moe.renormalize) == (48, False)
    q3 = DecoderArch.from_hf_config(_config(moe_model, "qwen3_moe"))
    assert q3.qk_norm and not q3.qkv_bias and q3.moe is not None and q3.moe.renormalize
    assert DecoderArch.from_hf_config({**_config(moe_model, "mixtral"), "model_type": "mistral"}).moe is None


def test_tensor_parallel_needs_the_expert_widths_to_divide(moe_model):
    arch = DecoderArch.from_hf_config(_config(moe_model, "qwen2_moe"))
    shard = TPShard.of(arch, 1, 2)
    assert (shard.moe_intermediate, shard.shared_expert_intermediate, shard.intermediate) == (16, 24, 48)
    with pytest.raises(ValueError, match=r"expert intermediate size \(32\) must be divisible by tensor parallel "
                                         r"size \(3\)"):
        TPShard.of(arch, 0, 3)
    cfg = {**_config(moe_model, "qwen3_moe"), "intermediate_size": 97, "mlp_only_layers": []}
    all_sparse = DecoderArch.from_hf_config({**cfg, "decoder_sparse_step": 1})
    assert TPShard.of(all_sparse, 0, 2).moe_intermediate == 16   # no dense layer: intermediate_size unused
    with pytest.raises(ValueError, match=r"intermediate_size \(97\) must be divisible by tensor parallel size"):
        TPShard.of(DecoderArch.from_hf_config(cfg), 0, 2)
