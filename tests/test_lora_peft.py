"""`polyrunner.lora.peft`: PEFT adapters made with `peft` read back exactly (every module's
`b @ a` is peft's merged-minus-base weight, float32) and refused with messages naming the
module or field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_adapters import ALL_LINEAR, ATTENTION, MLP, make_peft_adapter, merged_model
from polyrunner.lora.peft import PeftAdapter, check_adapter, read_adapter
from polyrunner.models.arch import DecoderArch
from polyrunner.models.moe_arch import MoEArch

ATTN_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")


def _arch(folder: Path) -> DecoderArch:
    return DecoderArch.from_hf_config(json.loads((folder / "config.json").read_text()))


def _linear(model, layer: int, name: str) -> torch.Tensor:
    block = model.model.layers[layer]
    return getattr(block.self_attn if name in ATTN_NAMES else block.mlp, name).weight


def _assert_matches_merge(adapter: PeftAdapter, base, merged, expect_modules: set, embed: bool, lm_head: bool):
    """Every adapted module's b @ a equals merged - base; every other linear is unchanged by the merge."""
    assert set(adapter.modules) == expect_modules
    for layer in range(len(base.model.layers)):
        for name in ALL_LINEAR:
            delta = _linear(merged, layer, name) - _linear(base, layer, name)
            if (layer, name) in adapter.modules:
                w = adapter.modules[(layer, name)]
                assert w.a.dtype == w.b.dtype == torch.float32
                torch.testing.assert_close(w.b @ w.a, delta, atol=2e-6, rtol=1e-5, msg=f"{name} of layer {layer}")
            else:
                assert torch.equal(delta, torch.zeros_like(delta)), f"{name} of layer {layer}"
    if embed:   # the embedding matrix is [vocab, hidden]; its update (b @ a) is [hidden, vocab]
        delta = merged.model.embed_tokens.weight - base.model.embed_tokens.weight
        torch.testing.assert_close(adapter.embed_tokens.b @ adapter.embed_tokens.a, delta.t(), atol=2e-6, rtol=1e-5)
    else:
        assert adapter.embed_tokens is None
    if lm_head:
        delta = merged.lm_head.weight - base.lm_head.weight
        torch.testing.assert_close(adapter.lm_head.b @ adapter.lm_head.a, delta, atol=2e-6, rtol=1e-5)
    else:
        assert adapter.lm_head is None


CASES = {   # id -> (model kind, rank, targets, with_embed, with_lm_head, extra LoraConfig fields)
    "llama-r4-attention": ("llama", 4, ATTENTION, False, False, {}),
    "llama-r8-mlp": ("llama", 8, MLP, False, False, {}),
    "llama-r16-all-embed-lm_head": ("llama", 16, ALL_LINEAR, True, True, {}),
    "qwen3-r8-rslora-patterns-embed": ("qwen3", 8, ALL_LINEAR, True, False, dict(
        use_rslora=True, rank_pattern={"q_proj": 4, "model.layers.1.mlp.down_proj": 16},
        alpha_pattern={"layers.1.self_attn.v_proj": 3, "gate_proj": 40})),
    "qwen3-r16-attention-layer1": ("qwen3", 16, ATTENTION, False, False, dict(layers_to_transform=[1])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_matches_peft_merge(case, tiny_model_factory, tmp_path):
    kind, rank, targets, embed, lm_head, extra = CASES[case]
    folder, base = tiny_model_factory(kind)
    path = make_peft_adapter(folder, tmp_path / "adapter", rank, targets, seed=7, with_embed=embed,
                             with_lm_head=lm_head, **extra)
    adapter = read_adapter(path, max_lora_rank=16)
    check_adapter(adapter, _arch(folder))
    layers = extra.get("layers_to_transform", range(base.config.num_hidden_layers))
    _assert_matches_merge(adapter, base, merged_model(folder, path), {(i, n) for i in layers for n in targets},
                          embed, lm_head)
    ranks = {w.rank for w in adapter.modules.values()}
    if "rank_pattern" in extra:   # q_proj at 4, one down_proj at 16, the rest at r
        assert adapter.modules[(0, "q_proj")].rank == 4 and adapter.modules[(1, "down_proj")].rank == 16
        assert ranks == {4, 8, 16}
    else:
        assert ranks == {rank}
    assert adapter.rank == max(ranks)


def test_helper_randomises_and_keeps_the_base_model(tiny_model_factory, tmp_path):
    """The adapter changes every target (peft's zero lora_B redrawn); a passed model is copied, not wrapped."""
    folder, base = tiny_model_factory("llama")
    before = {k: v.clone() for k, v in base.state_dict().items()}
    a = read_adapter(make_peft_adapter(base, tmp_path / "a", 8, ["q_proj"], seed=1, with_embed=True), 8)
    b = read_adapter(make_peft_adapter(folder, tmp_path / "b", 8, ["q_proj"], seed=2, with_embed=True), 8)
    assert type(base).__name__ == "LlamaForCausalLM" and base.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())
    for w in (*a.modules.values(), a.embed_tokens):
        assert (w.b @ w.a).abs().mean() > 1e-2
    assert not torch.equal(a.modules[(0, "q_proj")].b, b.modules[(0, "q_proj")].b)


# ---- refusals -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_adapter(tiny_model_factory, tmp_path_factory):
    """(base folder, an r=8 attention + MLP adapter folder) for the error cases to copy and damage."""
    folder, _ = tiny_model_factory("llama")
    return folder, Path(make_peft_adapter(folder, tmp_path_factory.mktemp("lora") / "a", 8, ALL_LINEAR, seed=3))


def _copy(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    """`src` copied to `dst` with config fields replaced and the tensors passed through `tensors`."""
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    state = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(state) if tensors else state, str(dst / "adapter_model.safetensors"))
    return dst


def test_rank_above_max_lora_rank(llama_adapter, tiny_model_factory, tmp_path):
    _, path = llama_adapter
    with pytest.raises(ValueError, match="LoRA rank 8 is greater than max_lora_rank 4"):
        read_adapter(path, max_lora_rank=4)
    read_adapter(path, max_lora_rank=8)
    folder, _ = tiny_model_factory("llama")   # one module above the limit through rank_pattern
    wide = make_peft_adapter(folder, tmp_path / "w", 8, MLP, rank_pattern={"layers.1.mlp.up_proj": 32})
    with pytest.raises(ValueError, match=r"LoRA rank 32 is greater than max_lora_rank 16 \(module "
                                         r"model\.layers\.1\.mlp\.up_proj"):
        read_adapter(wide, max_lora_rank=16)


@pytest.mark.parametrize("lora_config, message", [
    (dict(modules_to_save=["lm_head"]), r"'modules_to_save': only modules_to_save being None is supported"),
    (dict(use_dora=True), r"'use_dora': DoRA is not supported"),
], ids=["modules_to_save", "dora"])
def test_peft_features_refused(lora_config, message, tiny_model_factory, tmp_path):
    folder, _ = tiny_model_factory("llama")
    path = make_peft_adapter(folder, tmp_path / "a", 4, ATTENTION, **lora_config)
    with pytest.raises(ValueError, match=message):
        read_adapter(path, 16)


@pytest.mark.parametrize("fields, message", [
    ({"bias": "lora_only"}, r"field 'bias': adapter bias is not supported; it must be \"none\", got 'lora_only'"),
    ({"fan_in_fan_out": True}, r"field 'fan_in_fan_out': it must be false"),
    ({"r": "8"}, r"field 'r': Input should be a valid integer, got '8'"),
    ({"r": 0}, r"field 'r': Input should be greater than or equal to 1, got 0"),
    ({"lora_alpha": -1}, r"field 'lora_alpha': Input should be greater than 0"),
    ({"peft_type": "IA3"}, r"field 'peft_type' must be \"LORA\", got 'IA3'"),
    ({"r": 4}, r"model\.layers\.0\.mlp\.down_proj: adapter_config\.json gives rank 4 \(r / rank_pattern\) but its "
               r"tensors have rank 8"),
], ids=["bias", "fan_in_fan_out", "r-type", "r-range", "alpha-range", "peft_type", "rank-disagrees"])
def test_config_fields_refused(fields, message, llama_adapter, tmp_path):
    path = _copy(llama_adapter[1], tmp_path / "a", config=fields)
    with pytest.raises(ValueError, match=message):
        read_adapter(path, 16)


def test_missing_files(llama_adapter, tmp_path):
    with pytest.raises(ValueError, match=r"No adapter found for .*nowhere: not a folder"):
        read_adapter(tmp_path / "nowhere", 16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"No adapter found for .*empty: adapter_config\.json is missing"):
        read_adapter(tmp_path / "empty", 16)
    no_weights = _copy(llama_adapter[1], tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors is missing"):
        read_adapter(no_weights, 16)
    (no_weights / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors: not a readable safetensors file"):
        read_adapter(no_weights, 16)


def test_bin_adapter_refused(tiny_model_factory, tmp_path):
    folder, _ = tiny_model_factory("llama")
    path = Path(make_peft_adapter(folder, tmp_path / "a", 4, ["q_proj"], safe_serialization=False))
    assert (path / "adapter_model.bin").is_file() and not (path / "adapter_model.safetensors").exists()
    with pytest.raises(ValueError, match=r"adapter_model\.bin is not supported; save the adapter with "
                                         r"safe_serialization=True"):
        read_adapter(path, 16)


def test_tensor_errors(llama_adapter, tmp_path):
    src = llama_adapter[1]
    no_b = _copy(src, tmp_path / "no_b", tensors=lambda s: {k: v for k, v in s.items()
                                                            if k != next(k for k in sorted(s) if "lora_B" in k)})
    with pytest.raises(ValueError, match=r"module model\.layers\.0\.mlp\.down_proj has no lora_B weight"):
        read_adapter(no_b, 16)
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    bad_rank = _copy(src, tmp_path / "bad_rank", tensors=lambda s: {**s, key: s[key][:, :6].contiguous()})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj: lora_A \(8, 64\) and lora_B "
                                         r"\(32, 6\) must share the rank"):
        read_adapter(bad_rank, 16)
    both = _copy(src, tmp_path / "both", tensors=lambda s: {
        **s, **{k.replace("q_proj", "qkv_proj"): v.clone() for k, v in s.items() if ".0.self_attn.q_proj" in k}})
    with pytest.raises(ValueError, match="layer 0 adapts both qkv_proj and q_proj"):
        read_adapter(both, 16)
    extra = _copy(src, tmp_path / "extra", tensors=lambda s: {**s, key.replace("lora_B", "lora_magnitude_vector"):
                                                               torch.ones(32)})
    with pytest.raises(ValueError, match="unsupported tensor 'base_model.model.model.layers.1.self_attn.k_proj."
                                         "lora_magnitude_vector.weight'"):
        read_adapter(extra, 16)


def test_unknown_target_refused(tmp_path):
    """A genuine peft adapter of another architecture (GPT-NeoX's fused query_key_value): vLLM's message."""
    import transformers as tf
    torch.manual_seed(0)
    neox = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=4, intermediate_size=64))
    path = make_peft_adapter(neox, tmp_path / "neox", 4, ["query_key_value"])
    with pytest.raises(ValueError) as info:
        read_adapter(path, 16)
    assert str(info.value) == (
        f"While loading {path}, expected target modules in ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'qkv_proj', "
        "'gate_proj', 'up_proj', 'down_proj', 'gate_up_proj', 'embed_tokens', 'lm_head'] but received "
        "['gpt_neox.layers.0.attention.query_key_value']. Please verify that the loaded LoRA module is correct")


def test_moe_experts_refused(tmp_path):
    """A MoE model's experts (parameters in transformers 5) and its shared expert are no targets."""
    import transformers as tf
    torch.manual_seed(0)
    moe = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2))
    experts = make_peft_adapter(moe, tmp_path / "experts", 4, ["q_proj"], target_parameters=["experts.down_proj"])
    with pytest.raises(ValueError, match=r"'target_parameters': LoRA on parameters \(a MoE layer's experts\)"):
        read_adapter(experts, 16)
    shared = make_peft_adapter(moe, tmp_path / "shared", 4, ["shared_expert.gate_proj"])
    with pytest.raises(ValueError, match=r"LoRA on a mixture-of-experts layer's experts is not supported \(module "
                                         r"model\.layers\.0\.mlp\.shared_expert\.gate_proj\)"):
        read_adapter(shared, 16)


def test_shapes_checked_against_the_model(llama_adapter, tiny_model_factory):
    folder, path = llama_adapter
    adapter = read_adapter(path, 16)
    arch = _arch(folder)
    check_adapter(adapter, arch)
    wider = _arch(tiny_model_factory("llama_odd")[0])   # hidden 96, 6 heads of 16, 3 KV heads
    with pytest.raises(ValueError, match=r"LoRA module down_proj of layer 0: lora_B has shape \(64, 8\), the "
                                         r"model needs \(96, 8\)"):
        check_adapter(adapter, wider)
    with pytest.raises(ValueError, match=r"LoRA module k_proj of layer 0: lora_B has shape \(32, 8\), the model "
                                         r"needs \(64, 8\)"):
        check_adapter(adapter, dataclasses.replace(arch, num_kv_heads=4))
    with pytest.raises(ValueError, match=r"LoRA module down_proj of layer 1: the layer index must be in \[0, 0\] "
                                         r"\(the model has 1 layers\)"):
        check_adapter(adapter, dataclasses.replace(arch, num_layers=1))
    moe = MoEArch(num_experts=4, top_k=2, intermediate=32, renormalize=True, sparse_layers=(False, True))
    with pytest.raises(ValueError, match=r"LoRA module down_proj of layer 1: layer 1's MLP is a mixture of experts; "
                                         r"its experts are not LoRA targets"):
        check_adapter(adapter, dataclasses.replace(arch, moe=moe))
    attention_only = PeftAdapter(adapter.rank, {k: w for k, w in adapter.modules.items() if k[1] in ATTENTION})
    check_adapter(attention_only, dataclasses.replace(arch, moe=moe))   # attention of a MoE layer is fine


def test_embed_and_lm_head_shapes(tiny_model_factory, tmp_path):
    folder, _ = tiny_model_factory("llama")
    adapter = read_adapter(make_peft_adapter(folder, tmp_path / "a", 4, [], with_embed=True, with_lm_head=True), 16)
    assert adapter.modules == {} and adapter.rank == 4
    arch = _arch(folder)
    check_adapter(adapter, arch)
    with pytest.raises(ValueError, match=r"LoRA module embed_tokens: lora_A has shape \(4, 512\), the model needs "
                                         r"\(4, 600\)"):
        check_adapter(adapter, dataclasses.replace(arch, vocab_size=600))
    with pytest.raises(ValueError, match=r"LoRA module lm_head: lora_B has shape \(512, 4\), the model needs "
                                         r"\(600, 4\)"):
        check_adapter(PeftAdapter(4, {}, lm_head=adapter.lm_head), dataclasses.replace(arch, vocab_size=600))
