"""The all-decode fast path (scheduler, runner inputs) against the general path.

Each workload runs twice, once as shipped and once with the fast path switched
off (`Scheduler._schedule_decodes` always declining, `next_decode_inputs`
never reusing a step); every scheduling decision and every output must match:
scheduled tokens and blocks, preemptions, finish reasons, stop reasons, tokens,
logprobs. Workloads mix EOS, stop_token_ids, min_tokens, max_tokens,
max_model_len, ignore_eos, aborts, prefix caching and pools small enough to
preempt.
"""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import polyrunner.runner.model_runner as runner_mod
from polyrunner import LLM, SamplingParams
from polyrunner.config import SchedulerConfig
from polyrunner.engine.kv_manager import KVCacheManager
from polyrunner.engine.request import Request
from polyrunner.engine.scheduler import Scheduler
from scheduler_driver import drive
from tiny_models import kv_bytes

MAX_MODEL_LEN = 96
EOS = 2
STOP = 5


class GeneralScheduler(Scheduler):
    """The general loop only."""

    def _schedule_decodes(self, out, budget):
        return False


class CountingScheduler(Scheduler):
    """As shipped; counts the steps the fast path took."""

    fast_steps = 0

    def _schedule_decodes(self, out, budget):
        taken = super()._schedule_decodes(out, budget)
        self.fast_steps += taken
        return taken


def _token(seed: int, rid: str, n_out: int) -> int:
    """The 'sampled' token: a function of the request and its progress only, so
    both schedulers see the same tokens whatever their order; small ids hit EOS/STOP."""
    return random.Random(f"{seed}/{rid}/{n_out}").randrange(0, 40)


def _run(cls, specs, budget, max_seqs, num_blocks, block_size, chunked, prefix, seed, pass_array):
    kv = KVCacheManager(num_blocks, block_size, prefix)
    sched = cls(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                enable_chunked_prefill=chunked), kv, MAX_MODEL_LEN)
    rng = random.Random(seed)
    family = [rng.randrange(3, 500) for _ in range(MAX_MODEL_LEN)]
    reqs = []
    for i, (plen, max_tokens, min_tokens, ignore_eos, stop, arrival, abort_at) in enumerate(specs):
        plen = min(plen, MAX_MODEL_LEN - 1, (num_blocks - 1) * block_size - max_tokens)
        if plen < 1:
            continue
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                                ignore_eos=ignore_eos, stop_token_ids=[STOP] if stop else [])
        req = Request(f"r{i}", family[:plen], params, min(max_tokens, MAX_MODEL_LEN - plen),
                      frozenset({EOS}))
        reqs.append((arrival, abort_at, req))
    trace = []
    for _ in drive(sched, reqs):
        out = sched.schedule()
        sampled = {}
        for s in out.scheduled:
            req = s.request
            if req.num_computed_tokens + s.num_tokens == req.num_tokens:
                sampled[req.request_id] = [_token(seed, req.request_id, req.num_output_tokens)]
        trace.append(([(s.request.request_id, s.num_tokens, list(s.new_block_ids), s.is_new)
                       for s in out.scheduled], sorted(out.preempted_req_ids), sorted(out.finished_req_ids),
                      sorted(kv._computing.items())))  # blocks noted as being computed this step
        decode_tokens = None
        if pass_array and out.decodes:
            decode_tokens = np.array([sampled.pop(r.request_id)[0] for r in out.decodes], np.int64)
        updated = sched.update_from_output(out, sampled, decode_tokens)
        trace.append(([r.request_id for r in updated], [r.request_id for r in sched.finished_in_update]))
    result = [(r.request_id, r.status, r.stop_reason, list(r.output_token_ids), r.num_preemptions)
              for _, _, r in reqs]
    assert kv.pool.num_free_blocks == num_blocks - 1 and not kv.blocks
    return trace, result, sched


request_spec = st.tuples(
    st.integers(1, 60),                          # prompt length
    st.integers(1, 30),                          # max tokens
    st.integers(0, 6),                           # min tokens
    st.booleans(),                               # ignore_eos
    st.booleans(),                               # stop_token_ids=[STOP]
    st.integers(0, 20),                          # arrival step
    st.one_of(st.none(), st.integers(0, 40)),    # abort at step
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=16),
       budget=st.integers(8, 96), max_seqs=st.integers(1, 8), num_blocks=st.integers(9, 40),
       block_size=st.sampled_from([4, 8, 16]), chunked=st.booleans(), prefix=st.booleans(),
       seed=st.integers(0, 1000), pass_array=st.booleans())
def test_fast_path_matches_general_loop(specs, budget, max_seqs, num_blocks, block_size, chunked,
                                        prefix, seed, pass_array):
    if not chunked:
        budget = max(budget, MAX_MODEL_LEN)
    args = (specs, budget, max_seqs, num_blocks, block_size, chunked, prefix, seed)
    fast_trace, fast_result, _ = _run(CountingScheduler, *args, pass_array)
    slow_trace, slow_result, _ = _run(GeneralScheduler, *args, False)
    assert fast_trace == slow_trace
    assert fast_result == slow_result


def test_fast_path_is_taken_and_stops_rows():
    """A fixed decode-heavy workload: the fast path runs most steps and still
    finishes rows by EOS, stop id, min_tokens and length exactly as the loop."""
    specs = [(8 + i, 20 + i % 7, i % 4, i % 3 == 0, i % 2 == 0, 0, None) for i in range(8)]
    args = (specs, 256, 8, 64, 4, True, True, 7)
    fast_trace, fast_result, sched = _run(CountingScheduler, *args, True)
    slow_trace, slow_result, _ = _run(GeneralScheduler, *args, False)
    assert fast_trace == slow_trace and fast_result == slow_result
    assert sched.fast_steps > len(fast_trace) // 4
    reasons = {(status.value, stop) for _, status, stop, _, _ in fast_result}
    assert ("stop", None) in reasons or ("stop", STOP) in reasons


# ---- whole engine ---------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


def _engine_outputs(folder, hf, fast: bool, monkeypatch):
    if not fast:
        monkeypatch.setattr(Scheduler, "_schedule_decodes", lambda self, out, budget: False)
        monkeypatch.setattr(runner_mod, "next_decode_inputs", lambda *a: None)
    llm = LLM(str(folder), backend="cpu", dtype="float32", block_size=16, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=160, enable_prefix_caching=True,
              kv_cache_memory_bytes=kv_bytes(hf, 12))
    eng = llm.engine
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 512, size=20).tolist()
    for i in range(10):
        prompt = (shared if i % 3 == 0 else []) + rng.integers(3, 512, size=int(rng.integers(2, 30))).tolist()
        params = SamplingParams(
            temperature=0.0 if i % 2 == 0 else 0.9, seed=None if i % 2 == 0 else 100 + i,
            max_tokens=10 + 7 * (i % 4), min_tokens=3 * (i % 3), ignore_eos=i % 5 == 4,
            stop_token_ids=[int(rng.integers(3, 512))] if i % 4 == 1 else [],
            logprobs=2 if i % 3 == 2 else None)
        eng.add_request({"prompt_token_ids": prompt}, params, request_id=f"q{i}", stream=i == 5)
    outs = {}
    stream_steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == "q5" and not o.finished:
                stream_steps += 1
            if o.finished:
                c = o.outputs[0]
                lps = None if c.logprobs is None else [sorted((t, round(lp.logprob, 4)) for t, lp in pos.items())
                                                       for pos in c.logprobs]
                outs[o.request_id] = (c.token_ids, c.finish_reason, c.stop_reason, lps)
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_usable_blocks
    return outs, eng.scheduler.num_preemptions, stream_steps


def test_engine_fast_path_matches_general_path(model, monkeypatch):
    folder, hf = model
    fast = _engine_outputs(folder, hf, True, monkeypatch)
    with monkeypatch.context() as m:
        slow = _engine_outputs(folder, hf, False, m)
    assert len(fast[0]) == 10
    assert fast == slow
    assert fast[1] > 0, "the KV budget was meant to force preemption"
