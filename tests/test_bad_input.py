"""Bad input gets a clear error naming the problem; good requests still run."""

import json
import shutil

import pytest

from polyrunner import LLM, SamplingParams
from polyrunner.plugins import select_backend


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    return LLM(str(folder), backend="cpu", dtype="float32", max_model_len=64, max_num_seqs=4)


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": list(range(3, 67))}, "max_model_len is 64"),
    ({"prompt_token_ids": []}, "The decoder prompt cannot be empty"),   # vLLM's wording
    ({"prompt_token_ids": [5, 512]}, "allowed range is [0, 511]"),
    ({"prompt_token_ids": [5, -1]}, "allowed range is [0, 511]"),
    ("text prompt", "no tokenizer"),
    (42, "prompt must be a string or a dict"),
])
def test_bad_prompt_raises(llm, prompt, message):
    with pytest.raises(ValueError) as exc:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert message in str(exc.value)
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_below_one():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_one_bad_prompt_does_not_lose_the_others(llm):
    good = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    outs = llm.generate([good[0], {"prompt_token_ids": [5, 9999]}, good[1]], GREEDY, use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, True]
    assert "9999" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    alone = llm.generate(good, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in alone]
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'nope'.*known backends: .*cpu"):
        select_backend("nope")


def test_unavailable_backend_names_reason():
    with pytest.raises(RuntimeError, match="backend 'npu' is unavailable: "):
        select_backend("npu")


def test_folder_without_config(tmp_path, tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    shutil.copytree(folder, tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path / "m"), backend="cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "missing"), backend="cpu")


def test_unsupported_architecture(tmp_path, tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    shutil.copytree(folder, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path / "m"), backend="cpu")


def test_bad_engine_config(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(str(folder), backend="cpu", max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        LLM(str(folder), backend="cpu", max_model_len=100000)


def test_request_larger_than_kv_cache(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", kv_cache_memory_bytes=4 * 8192)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate({"prompt_token_ids": list(range(3, 100))}, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("params, message", [
    ({"max_tokens": 2}, r"^sampling_params must be a SamplingParams or a list of SamplingParams \(one per prompt\), "
                        r"got dict \(pass SamplingParams\(\*\*that_dict\)\)$"),
    ("greedy", r"^sampling_params must be a SamplingParams or a list of SamplingParams .*got str$"),
    ([GREEDY, {"max_tokens": 2}], r"^sampling_params\[1\] must be a SamplingParams, got dict"),
])
def test_generate_rejects_what_is_not_sampling_params(llm, params, message):
    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}]
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    with pytest.raises(TypeError, match=message):
        next(llm.generate_stream(prompts, params))
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate(prompts, [GREEDY, GREEDY], use_tqdm=False)   # vLLM's list form: one per prompt
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_beam_search_rejects_what_is_not_beam_search_params(llm):
    with pytest.raises(TypeError, match=r"^params must be a BeamSearchParams, got dict "
                                        r"\(pass BeamSearchParams\(\*\*that_dict\)\)$"):
        llm.beam_search([{"prompt_token_ids": [5, 6]}], {"beam_width": 2})
    with pytest.raises(TypeError, match="params must be a BeamSearchParams, got SamplingParams"):
        llm.beam_search([{"prompt_token_ids": [5, 6]}], GREEDY)


def test_chat_rejects_what_is_not_sampling_params_before_templating(llm, monkeypatch):
    class NoTemplating:   # any use of the tokenizer fails the test: the check comes first
        def __getattr__(self, name):
            raise AssertionError(f"tokenizer.{name} used before the argument was checked")
    monkeypatch.setattr(llm.engine, "tokenizer", NoTemplating())
    with pytest.raises(TypeError, match=r"^sampling_params must be a SamplingParams or a list"):
        llm.chat([{"role": "user", "content": "hi"}], {"max_tokens": 2})
