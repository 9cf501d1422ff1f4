"""Op overrides (`polyrunner.ops`): `apply_overrides` replaces a model's modules per role (a shared
module once, innermost roles first, unknown roles refused), the engine applies a backend's
`op_overrides` before `make_executor`, and the role table is the one the docs give."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from polyrunner.attention.reference import reference_paged_attention
from polyrunner.models.arch import DecoderArch
from polyrunner.models.llama import LlamaForCausalLM
from polyrunner.ops import MODULE_ROLES, ROLES, GatedMLP, RMSNorm, RotaryEmbedding, apply_overrides

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def _model(qk_norm: bool = False) -> LlamaForCausalLM:
    arch = DecoderArch.from_hf_config(dict(
        architectures=["Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"], vocab_size=32, hidden_size=32,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, head_dim=8))
    return LlamaForCausalLM(arch, reference_paged_attention, 64)


class Wrapped(nn.Module):
    """A replacement that runs the module it replaces, keeping its call and attributes."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)   # forward_add, weight, gate_up_proj, ...


def test_a_shared_rotary_is_replaced_once_and_set_everywhere():
    model = _model()
    calls = []

    def factory(module):
        calls.append(module)
        return Wrapped(module)

    assert apply_overrides(model, {"rotary": factory}) == {"rotary": 1}
    assert len(calls) == 1 and isinstance(calls[0], RotaryEmbedding)
    rotaries = {id(model.rotary)} | {id(layer.self_attn.rotary) for layer in model.layers}
    assert rotaries == {id(model.rotary)} and isinstance(model.rotary, Wrapped)


def test_every_module_of_a_role_is_replaced_and_counted():
    model = _model(qk_norm=True)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert apply_overrides(model, {"rms_norm": Wrapped}) == {"rms_norm": len(norms)}   # 4 per layer + final
    assert not any(isinstance(m, RMSNorm) and not isinstance(p, Wrapped)
                   for p in model.modules() for m in p.children())


def test_a_factory_that_keeps_its_argument_replaces_nothing():
    model = _model()
    before = [id(m) for m in model.modules()]
    assert apply_overrides(model, {"linear": lambda m: m, "gated_mlp": lambda m: m}) == {"linear": 0, "gated_mlp": 0}
    assert [id(m) for m in model.modules()] == before


def test_inner_roles_go_first_and_prepare_sees_every_module_once():
    """The gated_mlp factory sees the replaced linears inside it; `prepare` gets the role's
    modules before the factory is called on any."""
    model = _model()
    events = []

    class Linears:
        def prepare(self, modules):
            events.append(("prepare", len(modules)))

        def __call__(self, module):
            events.append(("call", None))
            return Wrapped(module)

    def mlp_factory(mlp):
        assert isinstance(mlp.gate_up_proj, Wrapped) and isinstance(mlp.down_proj, Wrapped)
        return Wrapped(mlp)

    # the mapping's order is not the order of application
    assert apply_overrides(model, {"gated_mlp": mlp_factory, "linear": Linears()}) == {"linear": 8, "gated_mlp": 2}
    assert events == [("prepare", 8)] + [("call", None)] * 8
    assert all(isinstance(layer.mlp, Wrapped) for layer in model.layers)


@pytest.mark.parametrize("role", ["layernorm", "attention"])
def test_an_unknown_role_is_refused_naming_it_and_the_known_ones(role):
    with pytest.raises(ValueError, match=rf"unknown role\(s\) '{role}'; known roles: linear, rms_norm, rotary, "
                                         r"gated_mlp, moe, lora, lora_embedding \(attention is overridden by defining "
                                         r"Backend.attention\)"):
        apply_overrides(_model(), {role: Wrapped})


def test_a_model_without_the_hook_runs_as_it_is():
    model = GatedMLP(8, 16)
    assert apply_overrides(model, {"linear": Wrapped}) == {}
    assert type(model.gate_up_proj) is nn.Linear


def test_the_engine_applies_the_overrides_before_make_executor(tiny_model_factory):
    from polyrunner import LLM, SamplingParams
    from polyrunner.backends.cpu.plugin import CPUBackend
    from polyrunner.plugins import hookimpl, register
    from polyrunner.plugins.manager import unregister
    seen = {}

    class MarkingBackend(CPUBackend):
        name = "test-op-overrides"
        priority = -100

        def op_overrides(self, dtype):
            seen["dtype"] = dtype
            return {"rms_norm": Wrapped, "gated_mlp": Wrapped}

        def make_executor(self, model):
            seen["norms"] = sum(isinstance(m, Wrapped) and isinstance(m.inner, RMSNorm) for m in model.modules())
            return super().make_executor(model)

    class Plugin:
        PLUGIN_API_VERSION = "1.0"

        @hookimpl
        def polyrunner_backends(self):
            return [MarkingBackend]

    register(Plugin(), name="test-op-overrides")
    try:
        folder, _ = tiny_model_factory("llama")
        llm = LLM(str(folder), backend="test-op-overrides", dtype="float32", max_model_len=64, max_num_seqs=2,
                  max_num_batched_tokens=64)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0),
                           use_tqdm=False)
    finally:
        unregister("test-op-overrides")
    model = llm.engine.runner.model
    assert seen["dtype"] == torch.float32 and seen["norms"] == 2 * len(model.layers) + 1
    assert all(isinstance(layer.mlp, Wrapped) for layer in model.layers)
    assert len(out[0].outputs[0].token_ids) == 2


def test_the_docs_give_every_role_of_the_table():
    section = GUIDE.read_text().split("## Op overrides")[1].split("\n## ")[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert documented == list(ROLES), f"docs/plugins.md's op overrides table: {documented}; the core: {list(ROLES)}"
    assert set(MODULE_ROLES) == set(ROLES) - {"attention"}
