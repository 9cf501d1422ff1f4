"""A bad model folder fails before anything is allocated, with an error that
names the file and the config field (and what the field allows)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from polyrunner import LLM
from polyrunner.models.arch import DecoderArch
from polyrunner.models.hf_config import ModelConfigTypeError, ModelFileError
from polyrunner.models.llama import LlamaForCausalLM
from polyrunner.tools.conformance.tiny_llama import TINY_LLAMA, write_tiny_llama


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def folder(good_folder, tmp_path) -> Path:
    """A private copy of the tiny model, to break."""
    return Path(shutil.copytree(good_folder, tmp_path / "m"))


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if a model is built: the error must come before any allocation."""
    def built(*args, **kwargs):
        raise AssertionError("the model was built: the bad config was not caught before allocation")
    monkeypatch.setattr(LlamaForCausalLM, "__init__", built)


def _load(folder: Path) -> LLM:
    return LLM(str(folder), backend="cpu", dtype="float32", max_model_len=64)


def _edit_config(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            del cfg[key]
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))
    return path


_DELETE = object()


def test_config_that_is_not_json_names_the_file_line_and_column(folder, no_model_built):
    path = folder / "config.json"
    path.write_text('{\n  "vocab_size": 256,\n  "hidden_size": 64,,\n}')
    with pytest.raises(ModelFileError) as exc:
        _load(folder)
    assert str(exc.value).startswith(f"{path}: not valid JSON: ")
    assert "(line 3, column 21)" in str(exc.value)
    path.write_text("[1, 2]")
    with pytest.raises(TypeError, match=f"{path}: must hold a JSON object, got list"):
        _load(folder)


@pytest.mark.parametrize("changes, error, message", [
    # a wrong JSON type: a TypeError (that is also a ModelFileError, a ValueError)
    ({"hidden_size": "64"}, TypeError, "config field 'hidden_size' must be an integer >= 1, got '64' (str)"),
    ({"vocab_size": 1e12}, TypeError,
     "config field 'vocab_size' must be an integer >= 1, got 1000000000000.0 (float)"),
    ({"tie_word_embeddings": "no"}, TypeError, "config field 'tie_word_embeddings' must be true or false"),
    ({"eos_token_id": "2"}, TypeError,
     "config field 'eos_token_id' must be an integer, a list of integers or null, got '2' (str)"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, TypeError,
     "config field 'rope_scaling.factor' must be a number > 0 or null, got '2' (str)"),
    # values out of range, or fields that do not fit together
    ({"num_attention_heads": 0}, ValueError, "config field 'num_attention_heads' must be an integer >= 1, got 0 (int)"),
    ({"num_key_value_heads": -2}, ValueError, "config field 'num_key_value_heads' must be an integer >= 1 or null"),
    ({"rms_norm_eps": 0}, ValueError, "config field 'rms_norm_eps' must be a number > 0, got 0 (int)"),
    ({"intermediate_size": _DELETE}, ValueError,
     "config field 'intermediate_size' is missing (it must be an integer >= 1)"),
    ({"num_attention_heads": 5}, ValueError,
     "config field 'num_attention_heads' must divide hidden_size (64) when head_dim is not set, got 5"),
    ({"num_key_value_heads": 3}, ValueError,
     "config field 'num_key_value_heads' must divide num_attention_heads (4), got 3"),
    ({"head_dim": 15}, ValueError, "config field 'head_dim' must be even (rotary embeddings rotate pairs), got 15"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, ValueError,
     "config field 'rope_scaling.rope_type' must be one of ('default', 'linear', 'llama3', 'longrope'), got 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ValueError,
     "config field 'rope_scaling.low_freq_factor' is missing"),
    # sizes the checkpoint does not have: checked against the safetensors header, nothing is read
    ({"vocab_size": 10**12}, ValueError, "config field 'vocab_size' does not match the checkpoint: tensor "
     "'model.embed_tokens.weight' in {shard} has shape [256, 64], the config implies dimension 0 = 1000000000000"),
    ({"hidden_size": 128}, ValueError, "config field 'hidden_size' does not match the checkpoint"),
    ({"intermediate_size": 4096}, ValueError, "config field 'intermediate_size' does not match the checkpoint"),
    ({"num_hidden_layers": 10**9}, ValueError, "config field 'num_hidden_layers' (1000000000) does not match the "
     "checkpoint, which holds layers 0..1 (2 layers)"),
])
def test_bad_config_field_is_named_with_the_file(folder, no_model_built, changes, error, message):
    path = _edit_config(folder, **changes)
    with pytest.raises(error) as exc:
        _load(folder)
    assert isinstance(exc.value, ModelFileError)   # one `except ValueError` catches every bad model file
    assert isinstance(exc.value, ModelConfigTypeError) == (error is TypeError)
    text = str(exc.value)
    assert text.startswith(f"{path}: "), text
    assert message.format(shard=folder / "model.safetensors") in text
    assert exc.value.field in message


def test_arch_from_a_plain_dict_names_config_json():
    with pytest.raises(ValueError, match=r"^config.json: config field 'num_attention_heads' must be an integer >= 1"):
        DecoderArch.from_hf_config({**TINY_LLAMA, "num_attention_heads": 0})
    arch = DecoderArch.from_hf_config({**TINY_LLAMA, "rope_theta": 500000, "eos_token_id": [2, 3]})
    assert (arch.rope_theta, arch.eos_token_ids, arch.head_dim) == (500000.0, (2, 3), 16)


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[: len(data) - 100], "incomplete metadata, file not fully covered"),   # truncated data
    (lambda data: data[:20], "invalid header length"),                                        # truncated header
    (lambda data: b"not a safetensors file at all" * 4, "header too large"),
])
def test_corrupt_or_truncated_safetensors_names_the_file(folder, no_model_built, damage, message):
    shard = folder / "model.safetensors"
    shard.write_bytes(damage(shard.read_bytes()))
    with pytest.raises(ModelFileError) as exc:
        _load(folder)
    assert str(exc.value).startswith(f"{shard}: corrupt or truncated safetensors file (")
    assert message in str(exc.value)


def test_sharded_index_errors_name_the_index(folder, no_model_built):
    index = folder / "model.safetensors.index.json"
    index.write_text("{oops")
    with pytest.raises(ModelFileError, match=f"^{index}: not valid JSON: .*line 1, column 2"):
        _load(folder)
    index.write_text(json.dumps({"weight_map": {"a": "model-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=f"{index}: lists shard 'model-00002.safetensors'"):
        _load(folder)


def test_a_good_folder_still_loads(good_folder):
    llm = _load(good_folder)
    assert llm.engine.arch.vocab_size == TINY_LLAMA["vocab_size"]
