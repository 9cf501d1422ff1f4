"""Speculative decoding (ngram) through the engine: greedy tokens equal the
non-speculative engine's on every tiny architecture, with chunked prefill, with
preemption forced and with the prefix cache reused; draft tokens stay within the
token budget; no KV block leaks; stop rules cut accepted tokens; bad configs are
refused with the field named."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from polyrunner import LLM, SamplingParams
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.device.buckets import BucketPolicy, exponential_sizes
from polyrunner.plugins import hookimpl, register
from polyrunner.plugins.manager import unregister

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _prompts() -> list[dict]:
    """Repetitive prompts (the n-gram lookup finds matches) and plain ones."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(6):
        motif = rng.integers(3, 500, size=5 + i).tolist()
        out.append({"prompt_token_ids": motif * 4 + motif[:2]})
    for n in (7, 33, 50):
        out.append({"prompt_token_ids": rng.integers(3, 500, size=n).tolist()})
    return out


def _run(folder, spec, prompts, params, **kw):
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=8, speculative_config=spec, **kw)
    budget = llm.engine.config.scheduler.max_num_batched_tokens
    sizes, drafted = [], []
    schedule = llm.engine.scheduler.schedule

    def watched():
        so = schedule()
        sizes.append(so.total_num_tokens)
        drafted.append(0 if so.num_draft_tokens is None else int(so.num_draft_tokens.sum()))
        return so

    llm.engine.scheduler.schedule = watched
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert max(sizes) <= budget   # drafts count against max_num_batched_tokens
    kv = llm.engine.kv
    assert kv.num_held_blocks() == 0 and kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    return llm, [o.outputs[0].token_ids for o in outs], sum(drafted)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("variant", ["plain", "chunked", "preempt"])
def test_greedy_equals_non_speculative(tiny_model_factory, kind, variant):
    folder, _ = tiny_model_factory(kind)
    kw = {"plain": {}, "chunked": dict(max_num_batched_tokens=24, long_prefill_token_threshold=16),
          "preempt": dict(num_gpu_blocks_override=12, block_size=8)}[variant]
    prompts, params = _prompts(), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _, base, _ = _run(folder, None, prompts, params, **kw)
    llm, spec, drafted = _run(folder, SPEC, prompts, params, **kw)
    assert spec == base
    stats = llm.engine.speculative_stats()
    assert drafted > 0 and stats.num_draft_tokens == drafted and stats.num_accepted_tokens > 0
    assert 0.0 < stats.acceptance_rate <= 1.0 and stats.mean_acceptance_length > 1.0
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    if variant == "plain":   # blocks filled under speculation serve later requests from the prefix cache
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert again == base and llm.engine.kv.pool.stats.hit_tokens > 0


def test_stop_rules_apply_to_accepted_tokens_in_order(tiny_model_factory):
    """A stop id, EOS and max_tokens reached inside a run of accepted drafts end the
    request there; min_tokens holds the stop back as without speculation."""
    folder, _ = tiny_model_factory("llama")
    prompts = _prompts()[:6]
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _, base, _ = _run(folder, None, prompts, free)
    stop = base[0][12]   # a token inside the repeated part of the first output
    cases = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop]),
             SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop], min_tokens=14),
             SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)]
    for params in cases:
        _, want, _ = _run(folder, None, prompts, params)
        _, got, drafted = _run(folder, SPEC, prompts, params)
        assert got == want and drafted > 0
    assert len(want[0]) == 13


def test_logprobs_and_penalties_rows_alongside_drafts(tiny_model_factory):
    """Rows that report logprobs or carry penalties run beside drafting rows; tokens
    and logprobs equal the non-speculative engine's."""
    folder, _ = tiny_model_factory("qwen2")
    prompts = _prompts()[:4]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)]
    base = LLM(str(folder), backend="cpu", dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(str(folder), backend="cpu", dtype="float32", speculative_config=SPEC)
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(base, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lp_a = [sorted(d) for d in base[3].outputs[0].logprobs]
    lp_b = [sorted(d) for d in spec[3].outputs[0].logprobs]
    assert lp_a == lp_b


def test_async_scheduling_default_is_off_with_speculation(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", speculative_config=SPEC)
    assert llm.engine.async_scheduling is False


@pytest.mark.parametrize("bad, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
])
def test_bad_speculative_config_names_the_field(tiny_model_factory, bad, field):
    folder, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match=field):
        LLM(str(folder), backend="cpu", dtype="float32", speculative_config=bad)


@pytest.mark.parametrize("kw, words", [(dict(async_scheduling=True), "async_scheduling")])
def test_refused_combinations(tiny_model_factory, kw, words):
    folder, _ = tiny_model_factory("llama")
    with pytest.raises(ValueError, match=words):
        LLM(str(folder), backend="cpu", dtype="float32", speculative_config=SPEC, **kw)


REPEAT = ("Repeat the following text exactly.\n\nText: The committee met on Tuesday to review the budget. "
          "After a long discussion, the members agreed to fund the new library and to repair the old bridge "
          "before winter.\n\nRepeated text: The committee met on Tuesday")


@pytest.fixture(scope="module")
def smollm_base():
    params = [SamplingParams(temperature=0.0, max_tokens=40),
              SamplingParams(temperature=0.0, max_tokens=40, stop=["library"])]
    base = LLM(dtype="float32", max_num_seqs=4).generate([REPEAT, REPEAT], params, use_tqdm=False)
    return params, base


@pytest.mark.parametrize("kw", [{}, dict(max_num_batched_tokens=16)])
def test_smollm2_greedy_equals_non_speculative(smollm_base, kw):
    """The embedded SmolLM2 (float32) repeating a text: same tokens and text, also with a
    stop string that falls inside accepted drafts; most drafts accepted."""
    params, base = smollm_base
    llm = LLM(dtype="float32", max_num_seqs=4, speculative_config=SPEC, **kw)
    spec = llm.generate([REPEAT, REPEAT], params, use_tqdm=False)
    for a, b in zip(base, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].text == a.outputs[0].text and b.outputs[0].finish_reason == a.outputs[0].finish_reason
    assert base[1].outputs[0].finish_reason == "stop"
    assert llm.engine.speculative_stats().acceptance_rate > 0.5


def test_serve_metrics_report_acceptance(tiny_model_factory):
    """`polyrunner serve`'s /metrics: vLLM's spec_decode counters plus acceptance gauges."""
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    from polyrunner.engine.async_llm import AsyncLLM
    from polyrunner.tools.serve.metrics import ServerMetrics
    folder, _ = tiny_model_factory("llama")
    a = AsyncLLM(str(folder), backend="cpu", dtype="float32", speculative_config=SPEC)
    try:
        async def run():
            async for _ in a.generate(_prompts()[0], SamplingParams(temperature=0.0, max_tokens=30,
                                                                    ignore_eos=True), "r0"):
                pass
        asyncio.run(run())
        deadline = time.monotonic() + 10
        while a.counts.spec_decode is None or not a.counts.spec_decode[1]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        text = ServerMetrics(a, "tiny").render()[0].decode()
    finally:
        a.shutdown(0)
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    stats = a.engine.speculative_stats()
    assert values["polyrunner:spec_decode_num_draft_tokens_total"] == stats.num_draft_tokens > 0
    assert values["polyrunner:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    assert values["polyrunner:spec_decode_acceptance_rate"] == pytest.approx(stats.acceptance_rate)
    assert values["polyrunner:spec_decode_mean_acceptance_length"] == pytest.approx(stats.mean_acceptance_length)


def test_structured_outputs_with_speculation():
    """Grammar masks apply at every draft position: JSON that validates, identical to
    the non-speculative engine's (greedy), with drafts proposed and accepted."""
    import json

    import jsonschema

    from polyrunner.sampling_params import StructuredOutputsParams
    schema = {"type": "object", "properties": {"people": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "enum": ["Ann", "Bob", "Cid"]},
                                         "city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["name", "city"]}}}, "required": ["people"]}
    prompt = ('Copy this JSON: {"people": [{"name": "Ann", "city": "Paris"}, {"name": "Bob", "city": "Rome"}, '
              '{"name": "Cid", "city": "Paris"}]}\nJSON: ')
    params = SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=schema))
    base = LLM(dtype="float32", max_num_seqs=2).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(dtype="float32", max_num_seqs=2, speculative_config=SPEC)
    spec = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(spec.text), schema)
    assert spec.token_ids == base.token_ids
    stats = llm.engine.speculative_stats()
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def _naive_ngram(seq: list[int], k: int, lo: int, hi: int, limit: int) -> list[int]:
    n_tok = len(seq)
    for n in range(hi, lo - 1, -1):
        if n >= n_tok:
            continue
        tail = seq[n_tok - n:]
        for i in range(n_tok - n - 1, -1, -1):   # the last earlier occurrence
            if seq[i:i + n] == tail:
                return seq[i + n:i + n + min(k, limit)]
    return []


def test_ngram_proposer_matches_a_plain_loop():
    from polyrunner.spec_decode import NgramProposer
    rng = np.random.default_rng(0)
    k, lo, hi, slots_n, width = 4, 2, 4, 16, 64
    proposer = NgramProposer(k, lo, hi)
    for _ in range(30):
        token_ids = rng.integers(0, 4, (slots_n, width)).astype(np.int32)   # small alphabet: many matches
        slots = rng.permutation(slots_n)[:10]
        num_tokens = rng.integers(1, width + 1, len(slots))
        limit = rng.integers(0, k + 1, len(slots))
        drafts, counts = proposer.propose(token_ids, slots, num_tokens, limit)
        for i, s in enumerate(slots.tolist()):
            want = _naive_ngram(token_ids[s, :num_tokens[i]].tolist(), k, lo, hi, int(limit[i]))
            assert drafts[i, :counts[i]].tolist() == want


class PaddedCPU(CPUBackend):
    """The CPU backend padding every step to power-of-two token and request buckets
    (as CUDA graph sizes): verification steps' token counts are padded too."""

    name = "cpu-padded-spec"
    priority = -100

    def bucket_policy(self):
        s = self.config.scheduler
        return BucketPolicy(exponential_sizes(1, s.max_num_batched_tokens), exponential_sizes(1, s.max_num_seqs))


class StaticCPU(PaddedCPU):
    name = "cpu-static-spec"
    capabilities = dataclasses.replace(CPUBackend.capabilities, static_shapes=True)


class _Plugin:
    PLUGIN_API_VERSION = "1.0"
    @hookimpl
    def polyrunner_backends(self):
        return [PaddedCPU, StaticCPU]


@pytest.fixture(scope="module")
def padded_backends():
    register(_Plugin(), name="test-spec-decode")
    yield
    unregister("test-spec-decode")


def test_padded_steps_equal_and_static_shapes_refused(tiny_model_factory, padded_backends):
    folder, _ = tiny_model_factory("llama")
    prompts, params = _prompts(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(folder), backend="cpu", dtype="float32").generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(str(folder), backend=PaddedCPU.name, dtype="float32", speculative_config=SPEC)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and llm.engine.speculative_stats().num_accepted_tokens > 0
    with pytest.raises(ValueError, match="static shapes"):
        LLM(str(folder), backend=StaticCPU.name, dtype="float32", speculative_config=SPEC)
