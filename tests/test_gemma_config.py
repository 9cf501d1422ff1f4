"""Gemma 2 / 3 config.json fields: both rope formats (transformers 5.x's per-layer-type
`rope_parameters` and the older hub keys) give the same architecture, transformers'
defaults fill what a config leaves out, bad values are refused naming the field; Gemma's
modules stay out of the roles whose contract is Llama's; the engine refuses a Gemma 2 on a
backend without soft-capping, naming the feature, the model and the backend."""

from __future__ import annotations

import pytest
import torch

from polyrunner.attention.reference import reference_paged_attention
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.device.backend import Capabilities
from polyrunner.models.arch import DecoderArch
from polyrunner.models.gemma import GemmaForCausalLM
from polyrunner.models.gemma_norm import GemmaRMSNorm
from polyrunner.models.hf_config import ACTIVATIONS, ModelFileError
from polyrunner.ops.gated_mlp import ACTIVATIONS as MLP_ACTIVATIONS

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)
GEMMA3 = dict(BASE, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=8)


def test_gemma3_hub_format_equals_transformers_5_format():
    old = dict(GEMMA3, rope_theta=20000.0, rope_local_base_freq=100.0, sliding_window_pattern=3,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    new = dict(GEMMA3, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    a, b = DecoderArch.from_hf_config(old), DecoderArch.from_hf_config(new)
    assert a == b
    assert a.sliding_windows == (8, 8, None, 8, 8, None)
    assert (a.rope_theta, a.rope_scaling) == (20000.0, {"rope_type": "linear", "factor": 2.0})
    assert (a.sliding_rope_theta, a.sliding_rope_scaling) == (100.0, None)
    assert a.qk_norm and a.tie_word_embeddings and a.hidden_act == "gelu_pytorch_tanh"
    assert a.attn_logit_softcapping is None and a.final_logit_softcapping is None
    assert a.embed_scale == 32 ** 0.5 and a.query_pre_attn_scalar == 256


def test_transformers_defaults_fill_what_a_config_leaves_out():
    g2 = DecoderArch.from_hf_config(dict(BASE, architectures=["Gemma2ForCausalLM"], model_type="gemma2"))
    assert g2.sliding_windows == (4096, None) * 3            # every other layer, window 4096
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.rope_theta == 10000.0 and g2.sliding_rope_theta == 10000.0 and not g2.qk_norm
    off = DecoderArch.from_hf_config(dict(BASE, model_type="gemma2", attn_logit_softcapping=None,
                                          final_logit_softcapping=None, tie_word_embeddings=False))
    assert off.attn_logit_softcapping is None and off.final_logit_softcapping is None
    assert not off.tie_word_embeddings
    g3 = DecoderArch.from_hf_config(GEMMA3)
    assert g3.sliding_windows == (8,) * 5 + (None,)           # sliding_window_pattern 6
    assert (g3.rope_theta, g3.sliding_rope_theta) == (1e6, 1e4)
    llama = DecoderArch.from_hf_config(dict(BASE, hidden_act="gelu"))   # other families: unchanged
    assert llama.hidden_act == "silu" and llama.embed_scale is None and llama.query_pre_attn_scalar is None


@pytest.mark.parametrize("fields, field, words", [
    ({"hidden_activation": "relu"}, "hidden_activation", "must be one of"),
    ({"hidden_act": "swish"}, "hidden_act", "must be one of"),
    ({"attn_logit_softcapping": 0}, "attn_logit_softcapping", "a number > 0 or null"),
    ({"final_logit_softcapping": -30.0}, "final_logit_softcapping", "a number > 0 or null"),
    ({"query_pre_attn_scalar": "256"}, "query_pre_attn_scalar", "a number > 0 or null"),
    ({"rope_local_base_freq": 0.0}, "rope_local_base_freq", "a number > 0 or null"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern", "an integer >= 1 or null"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention", "only causal attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear"}}},
     "rope_parameters.full_attention.factor", "is missing"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type", "must be one of"),
    ({"rope_parameters": {"full_attention": {"rope_theta": -1.0}}},
     "rope_parameters.full_attention.rope_theta", "a number > 0 or null"),
])
def test_bad_gemma_fields_are_refused_naming_the_field(fields, field, words):
    with pytest.raises(ModelFileError) as err:
        DecoderArch.from_hf_config(dict(GEMMA3, **fields), "/m/config.json")
    assert err.value.field == field
    assert f"/m/config.json: config field {field!r}" in str(err.value) and words in str(err.value)


def test_activation_names_agree():
    assert set(ACTIVATIONS) == set(MLP_ACTIVATIONS)


def test_gemma_modules_are_not_offered_in_llama_roles():
    """No "rms_norm" (Gemma's norm is not Llama's) and no "gated_mlp" (GeGLU, not SiLU); the
    linears and both rotary tables (global, local) are offered."""
    arch = DecoderArch.from_hf_config(dict(GEMMA3, rope_local_base_freq=100.0))
    model = GemmaForCausalLM(arch, reference_paged_attention, 64)
    places = list(model.replaceable_modules())
    assert {role for role, *_ in places} == {"linear", "rotary"}
    assert not any(isinstance(m, GemmaRMSNorm) for *_, m in places)
    rotaries = {id(m) for role, _, _, m in places if role == "rotary"}
    assert len(rotaries) == 2 and model.rotary_local is not None
    assert model.layers[0].self_attn.rotary is model.rotary_local
    assert model.layers[5].self_attn.rotary is model.rotary
    assert torch.equal(model.layers[5].self_attn.rotary.cos, model.rotary.cos)
    assert not torch.equal(model.rotary_local.cos, model.rotary.cos)


class NoSoftCapCPU(CPUBackend):
    name = "cpu_without_soft_cap"
    capabilities = Capabilities(graph_mode="cpu_graph", counts_graphs=True,
                                attention_features=frozenset({"sliding_window"}))


def test_engine_refuses_a_model_needing_a_missing_attention_feature(registered, tmp_path):
    from polyrunner import LLM
    from tiny_gemma import build_tiny_gemma
    build_tiny_gemma("gemma2", tmp_path)
    name = registered(NoSoftCapCPU)
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path), backend=name, dtype="float32")
    message = str(err.value)
    assert "logits_soft_cap" in message and "Gemma2ForCausalLM" in message and name in message
    assert "sliding_window," not in message   # only what is missing
