"""Sampling through the whole engine (`LLM(...)`, backend "cpu", float32, tiny model).

- batch invariance: seeded random requests give the same tokens run alone, in
  one batch, with chunked prefill forced and with preemption forced;
- requests without a seed draw from the engine seed;
- every invalid SamplingParams value (and every out-of-vocabulary token id)
  raises before anything is scheduled;
- n > 1 fans out into n completions.
"""

import numpy as np
import pytest
import torch

from polyrunner import LLM, SamplingParams
from tiny_models import kv_bytes

MAX_NEW = 8
BLOCK = 16


def _prompts(n: int = 16, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.permutation(np.arange(3, 64, 4))[:n]  # 16 distinct lengths, 3..63
    return [rng.integers(3, 512, size=int(k)).tolist() for k in lengths]


PROMPTS = _prompts()
TOP_P = [1.0, 0.9, 0.7, 0.95]
TOP_K = [0, 20, 0, 50, 5]


def _params(i: int, seed_base: int = 1000) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=TOP_P[i % len(TOP_P)], top_k=TOP_K[i % len(TOP_K)],
                          seed=seed_base + i, max_tokens=MAX_NEW, ignore_eos=True)


PARAMS = [_params(i) for i in range(len(PROMPTS))]



def _llm(folder, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 16)
    return LLM(str(folder), backend="cpu", dtype="float32", block_size=BLOCK, **kw)


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_clean(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_usable_blocks
    assert (eng.kv.pool.ref_cnt[1:] == 0).all()


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def alone(model):
    """Each request in its own `generate` call (no prefix cache, so nothing is shared)."""
    folder, _ = model
    llm = _llm(folder, enable_prefix_caching=False)
    outs = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False) for p, sp in zip(PROMPTS, PARAMS)]
    _assert_clean(llm)
    return [o[0].outputs[0].token_ids for o in outs]


def test_seeded_requests_really_sample(model, alone):
    """The invariance test below must be able to fail: seeds matter and sampling is not greedy."""
    folder, _ = model
    llm = _llm(folder)
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    differ = sum(g.outputs[0].token_ids != a for g, a in zip(greedy, alone))
    assert differ >= len(PROMPTS) // 2, "random sampling looks greedy"
    other = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                         [_params(i, seed_base=5000) for i in range(len(PROMPTS))], use_tqdm=False)
    assert sum(o.outputs[0].token_ids != a for o, a in zip(other, alone)) >= len(PROMPTS) // 2
    assert all(len(a) == MAX_NEW for a in alone)


VARIANTS = {
    "batch": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(),  # + a 12-block KV cache
    "preempt_no_prefix_cache": dict(enable_prefix_caching=False),
    "chunked_preempt": dict(max_num_batched_tokens=24),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batch_invariance(model, alone, variant):
    folder, hf = model
    kw = dict(VARIANTS[variant])
    if "preempt" in variant:
        kw["kv_cache_memory_bytes"] = kv_bytes(hf, 12, BLOCK)
    llm = _llm(folder, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    if "preempt" in variant:
        assert llm.engine.scheduler.num_preemptions > 0
    for i, (out, ref) in enumerate(zip(outs, alone)):
        assert out.outputs[0].token_ids == ref, f"{variant}: request {i} (prompt len {len(PROMPTS[i])})"
        assert out.outputs[0].finish_reason == "length"
    _assert_clean(llm)
    # the same batch again (prefix cache warm where enabled): still the same tokens
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert _tokens(again) == _tokens(outs)
    _assert_clean(llm)


def test_unseeded_requests_draw_from_engine_seed(model):
    folder, _ = model
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:6]]
    sp = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True)

    def run(seed: int):
        return _tokens(_llm(folder, seed=seed).generate(prompts, sp, use_tqdm=False))

    a, b, c = run(3), run(3), run(4)
    assert a == b
    assert a != c


def test_engine_seed_is_independent_of_the_global_rng(model):
    """Two engines with one seed, interleaved and with torch's RNG disturbed in
    between, still agree: the shared draw comes from the engine's own generator."""
    folder, _ = model
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    sp = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True)
    first, second = _llm(folder, seed=3), _llm(folder, seed=3)
    a = _tokens(first.generate(prompts, sp, use_tqdm=False))
    torch.rand(1000)
    b = _tokens(second.generate(prompts, sp, use_tqdm=False))
    assert a == b


# ---- validation before scheduling ------------------------------------------------------
INVALID = [
    dict(n=0), dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=-0.1), dict(min_p=1.1),
    dict(presence_penalty=2.5), dict(frequency_penalty=-2.5), dict(repetition_penalty=0.0),
    dict(seed=2 ** 64), dict(max_tokens=0), dict(min_tokens=-1), dict(min_tokens=9, max_tokens=8),
    dict(stop=[""]), dict(stop_token_ids=[-1]), dict(logprobs=-2), dict(prompt_logprobs=-2),
    dict(logit_bias={-1: 1.0}), dict(logit_bias={5: 101.0}), dict(logit_bias={5: float("nan")}),
    dict(allowed_token_ids=[]), dict(allowed_token_ids=[-3]), dict(bad_words=["  "]),
    dict(no_such_field=1),
]
OUT_OF_VOCAB = [
    dict(stop_token_ids=[512]), dict(stop_token_ids=[3, 10_000]), dict(logit_bias={512: 1.0}),
    dict(allowed_token_ids=[0, 512]),
]


@pytest.fixture(scope="module")
def watched(model):
    """An LLM whose engine counts scheduler steps."""
    folder, _ = model
    llm = _llm(folder)
    counts = {"schedule": 0}
    original = llm.engine.scheduler.schedule

    def schedule():
        counts["schedule"] += 1
        return original()

    llm.engine.scheduler.schedule = schedule
    return llm, counts


def _assert_nothing_scheduled(llm, counts, before: int) -> None:
    eng = llm.engine
    assert counts["schedule"] == before, "a step ran"
    assert not eng.scheduler.requests and not eng.scheduler.waiting and not eng.scheduler.running
    assert not eng.outputs._parents
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_usable_blocks


@pytest.mark.parametrize("bad", INVALID, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_invalid_params_raise_before_scheduling(watched, bad):
    llm, counts = watched
    before = counts["schedule"]
    with pytest.raises(ValueError) as info:
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(**bad), use_tqdm=False)
    assert any(name in str(info.value) for name in bad)  # the message names the field
    _assert_nothing_scheduled(llm, counts, before)
    # assigning the bad value to valid params raises too and leaves the params valid
    if "no_such_field" not in bad and len(bad) == 1:
        sp = SamplingParams()
        (field, value), = bad.items()
        with pytest.raises(ValueError):
            setattr(sp, field, value)
        llm.engine._validate([5, 6, 7], sp)  # still valid


@pytest.mark.parametrize("bad", OUT_OF_VOCAB, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_out_of_vocab_ids_raise_at_generate(watched, bad):
    llm, counts = watched
    sp = SamplingParams(**bad)  # fine on its own: the vocabulary is the model's
    before = counts["schedule"]
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)
    _assert_nothing_scheduled(llm, counts, before)
    with pytest.raises(ValueError):  # the streaming API rejects it before any step, too
        next(iter(llm.generate_stream({"prompt_token_ids": [5, 6, 7]}, sp)))
    _assert_nothing_scheduled(llm, counts, before)


def test_engine_level_rejections_before_scheduling(watched):
    llm, counts = watched
    before = counts["schedule"]
    for prompt, sp in [
        ({"prompt_token_ids": []}, SamplingParams()),
        ({"prompt_token_ids": [5, 512]}, SamplingParams()),
        ({"prompt_token_ids": [5] * 512}, SamplingParams()),         # max_model_len is 512
        ("text", SamplingParams()),                                    # no tokenizer
        ({"prompt_token_ids": [5]}, SamplingParams(bad_words=["x"])),  # needs a tokenizer
    ]:
        with pytest.raises(ValueError):
            llm.generate(prompt, sp, use_tqdm=False)
    _assert_nothing_scheduled(llm, counts, before)


def test_invalid_request_in_a_list_is_rejected_alone(watched):
    llm, counts = watched
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [5, 6, 7]}],
                        [good, SamplingParams(max_tokens=3, stop_token_ids=[600])], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3 and outs[0].error is None
    assert outs[1].outputs[0].finish_reason == "error" and "stop_token_ids" in outs[1].error
    _assert_clean(llm)


# ---- n > 1 -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fanout_llm(model):
    return _llm(model[0])


def test_n_random_gives_distinct_completions(fanout_llm):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    outs = fanout_llm.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True),
                               use_tqdm=False)
    assert len(outs) == 3
    for o, p in zip(outs, prompts):
        assert o.finished and o.prompt_token_ids == p["prompt_token_ids"]
        assert [c.index for c in o.outputs] == [0, 1, 2, 3]
        seqs = [tuple(c.token_ids) for c in o.outputs]
        assert all(len(s) == MAX_NEW for s in seqs)
        assert len(set(seqs)) == 4, "random completions of one prompt should differ"
    _assert_clean(fanout_llm)


def test_n_seeded_is_reproducible_and_distinct(fanout_llm):
    prompt = {"prompt_token_ids": PROMPTS[4]}
    sp = SamplingParams(n=3, temperature=0.8, seed=42, max_tokens=MAX_NEW, ignore_eos=True)
    a = fanout_llm.generate(prompt, sp, use_tqdm=False)[0]
    b = fanout_llm.generate([prompt, {"prompt_token_ids": PROMPTS[5]}], [sp, _params(5)], use_tqdm=False)[0]
    assert _tokens([a]) == _tokens([b])
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    _assert_clean(fanout_llm)


def test_n_greedy_gives_identical_completions(fanout_llm):
    prompt = {"prompt_token_ids": PROMPTS[2]}
    out = fanout_llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                              use_tqdm=False)[0]
    single = fanout_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                                 use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert all(c.token_ids == single.outputs[0].token_ids for c in out.outputs)
    assert all(c.finish_reason == "length" for c in out.outputs)
    _assert_clean(fanout_llm)


def test_abort_parent_with_n_frees_every_child(fanout_llm):
    eng = fanout_llm.engine
    rid = eng.add_request({"prompt_token_ids": PROMPTS[6]},
                          SamplingParams(n=3, temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv.num_held_blocks() > 0
    eng.abort_request(rid)
    assert not eng.has_unfinished_requests() and eng.runner.states.num_active == 3
    eng.step()   # a step without rows hands the aborted slots to the runner
    assert eng.runner.states.num_active == 0 and not eng.has_requests()
    _assert_clean(fanout_llm)
