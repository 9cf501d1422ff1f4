"""Outputs do not depend on the token budget.

Greedy float32 generation through `LLM` (backend "cpu", tiny random model) with
any `max_num_batched_tokens` in 1..64 and any `max_num_seqs` gives the tokens and
logprobs of the unchunked run, also with prefix caching, preemption (a KV pool
of a few blocks) and n-gram speculation on.

A one-token prefill chunk schedules exactly one token per row, the shape of a
decode step; its sample is thrown away and the next step must feed the
prompt's next token, not that sample (the bug this file was written for).

Chunking changes the order of float sums, so two runs may pick different
tokens where the reference's best two logprobs tie: a divergence is accepted
only there, and the comparison of that request stops at it.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyrunner import LLM, SamplingParams
from tiny_models import kv_bytes

MAX_NEW = 8
LOGPROBS = 2
TIE = 1e-3          # best-two logprob gap below which greedy may flip under reordered float sums
LOGPROB_TOL = 1e-4  # float32 logprobs of one model computed in differently-chunked orders

RNG = np.random.default_rng(2201)
# repeated n-grams give the n-gram proposer drafts to offer
PROMPTS = [RNG.integers(3, 512, size=int(n)).tolist() for n in (1, 5, 17, 33, 40)]
PROMPTS.append((PROMPTS[2][:6] * 5)[:27])
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=LOGPROBS, prompt_logprobs=1,
                        ignore_eos=True)
# rows that report logprobs get no drafts: speculation is checked on tokens alone
SPEC_PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    """(folder, KV-cache bytes of one block): small values, for hypothesis' reports."""
    folder, hf = tiny_model_factory("llama")
    return str(folder), kv_bytes(hf, 1)


def _run(folder, prompts, params=PARAMS, **kw):
    llm = LLM(str(folder), backend="cpu", dtype="float32", block_size=16, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eng = llm.engine
    assert not eng.kv.blocks, "a request still holds KV blocks"
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_usable_blocks
    stats = eng.speculative_stats()
    if stats is not None and any(len(p) >= 27 for p in prompts):
        assert stats.num_draft_tokens > 0, "the repeated prompt got no drafts"
    return outs


@pytest.fixture(scope="module")
def reference(model):
    folder, _ = model
    outs = _run(folder, PROMPTS, enable_prefix_caching=False)
    return {tuple(p): o for p, o in zip(PROMPTS, outs)}


def _top(entry: dict) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda x: -x[1])


def _assert_same_tokens(got, ref) -> int:
    """Compare sampled tokens; returns how many agree before a (tied) divergence."""
    g, r = got.outputs[0], ref.outputs[0]
    assert len(g.token_ids) == len(r.token_ids) == MAX_NEW
    for i, (gt, rt) in enumerate(zip(g.token_ids, r.token_ids)):
        if gt != rt:
            ref_top = _top(r.logprobs[i])
            assert ref_top[0][1] - ref_top[1][1] < TIE, (
                f"token {i}: {gt} instead of {rt} (not a tie: {ref_top}); got {g.token_ids}, want {r.token_ids}")
            return i
    return MAX_NEW


def _assert_same(got, ref) -> None:
    g, r = got.outputs[0], ref.outputs[0]
    assert len(g.logprobs) == len(r.logprobs) == MAX_NEW, "a sampled token lost its logprobs"
    agree = _assert_same_tokens(got, ref)
    for i, gt in enumerate(g.token_ids[:agree]):
        assert gt in g.logprobs[i]
        shared = sorted(set(g.logprobs[i]) & set(r.logprobs[i]))
        assert len(shared) >= LOGPROBS, (g.logprobs[i], r.logprobs[i])   # top-2 sets differ only on a tie
        np.testing.assert_allclose([g.logprobs[i][t].logprob for t in shared],
                                   [r.logprobs[i][t].logprob for t in shared], atol=LOGPROB_TOL)
    # prompt logprobs: position 0 has none, then one entry per prompt token
    assert len(got.prompt_logprobs) == len(ref.prompt_logprobs)
    for gp, rp, tok in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], got.prompt_token_ids[1:]):
        np.testing.assert_allclose(gp[tok].logprob, rp[tok].logprob, atol=LOGPROB_TOL)


@pytest.mark.parametrize("budget,seqs", [(1, 1), (2, 2), (1, 4), (3, 2)])
def test_tiny_budgets_match_unchunked(model, reference, budget, seqs):
    folder, _ = model
    outs = _run(folder, PROMPTS, max_num_batched_tokens=budget, max_num_seqs=seqs)
    for p, o in zip(PROMPTS, outs):
        _assert_same(o, reference[tuple(p)])


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_budget_matches_unchunked(model, reference, data):
    folder, block_bytes = model
    prompts = data.draw(st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=4), label="prompts")
    budget = data.draw(st.integers(1, 64), label="max_num_batched_tokens")
    seqs = data.draw(st.integers(1, 6), label="max_num_seqs")
    prefix = data.draw(st.booleans(), label="prefix caching")
    spec = data.draw(st.booleans(), label="ngram speculation")
    # 4 blocks of 16 hold the longest request (40 + 8 tokens); fewer than the batch needs preempts
    blocks = data.draw(st.sampled_from([None, 4, 6]), label="kv blocks")
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, enable_prefix_caching=prefix)
    if blocks is not None:
        kw["kv_cache_memory_bytes"] = blocks * block_bytes
    if spec:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    outs = _run(folder, prompts, SPEC_PARAMS if spec else PARAMS, **kw)
    for p, o in zip(prompts, outs):
        (_assert_same_tokens if spec else _assert_same)(o, reference[tuple(p)])
