"""Property tests: random request streams through the scheduler and block pool.

A fake runner "computes" scheduled tokens and samples a token for every request
that finished its prefill, so no model is needed. Invariants checked every step:
token budget and max_num_seqs never exceeded, blocks held == blocks needed,
no block shared without prefix caching, rows decode-first, every request in a
distinct stable slot (kept across preemption, freed when it finishes); at the end every request finished or
was aborted and every block is free. Asynchronously, each step is scheduled before the previous one is
updated (its tokens still in flight), and the same invariants hold.
"""

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polyrunner.config import SchedulerConfig
from polyrunner.engine.kv_manager import KVCacheManager
from polyrunner.engine.request import Request, RequestStatus
from polyrunner.engine.scheduler import Scheduler
from polyrunner.numeric import cdiv
from polyrunner.sampling_params import SamplingParams
from scheduler_driver import drive

MAX_MODEL_LEN = 128

request_spec = st.tuples(
    st.integers(1, 100),        # prompt length
    st.integers(1, 27),         # max tokens
    st.integers(0, 30),         # arrival step
    st.one_of(st.none(), st.integers(0, 40)),  # abort at step
    st.integers(0, 3),          # prompt family (shared prefixes exercise the prefix cache)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=24),
       budget=st.integers(8, 96), max_seqs=st.integers(1, 8), num_blocks=st.integers(9, 40),
       block_size=st.sampled_from([4, 8, 16]), chunked=st.booleans(), prefix=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), seed=st.integers(0, 1000), asynchronous=st.booleans())
def test_random_streams(specs, budget, max_seqs, num_blocks, block_size, chunked, prefix, policy, seed,
                        asynchronous):
    if not chunked:
        budget = max(budget, MAX_MODEL_LEN)
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, prefix)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                      enable_chunked_prefill=chunked, policy=policy), kv, MAX_MODEL_LEN)
    families = [[rng.randrange(3, 500) for _ in range(100)] for _ in range(4)]
    reqs = []
    for i, (plen, max_tokens, arrival, abort_at, fam) in enumerate(specs):
        plen = min(plen, MAX_MODEL_LEN - 1)
        # a request must fit in the pool on its own, as the engine checks at admission
        plen = min(plen, (num_blocks - 1) * block_size - max_tokens)
        if plen < 1:
            continue
        prompt = families[fam][:plen]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      min(max_tokens, MAX_MODEL_LEN - plen))
        if policy == "priority":   # later arrivals may outrank preempted requests that hold slots
            req.priority = rng.randrange(-3, 3)
        reqs.append((arrival, abort_at, req))
    first_slot = {}
    in_flight = None

    def update(out):
        sched.update(out, np.array([rng.randrange(3, 500) for _ in range(out.num_reqs)], np.int64))

    for _ in drive(sched, reqs):
        out = sched.schedule()
        assert out.total_num_tokens <= budget
        assert out.num_reqs <= max_seqs
        assert len(sched.running) <= max_seqs
        slotted = [r for r in list(sched.running) + list(sched.waiting) if r.slot is not None]
        assert len({r.slot for r in slotted}) == len(slotted) and all(0 <= r.slot < max_seqs for r in slotted)
        assert sched.slots.num_free == max_seqs - len(slotted)
        n = out.num_scheduled
        assert not (n[1:] == 1)[n[:-1] > 1].any(), "a decode row after a prefill row"
        for req, num, computed, slot in zip(out.requests, n.tolist(), out.num_computed.tolist(), out.slots.tolist()):
            assert num >= 1 and slot == req.slot and computed + num == req.num_computed_tokens
            assert first_slot.setdefault(req.request_id, slot) == slot, "a request changed slot"
            # a token still in flight (asynchronous) is scheduled before it is known
            assert computed + num <= req.num_tokens + (in_flight is not None)
            assert computed + num < min(req.num_prompt_tokens + req.max_tokens, MAX_MODEL_LEN)
            assert len(kv.blocks[req.request_id]) >= cdiv(computed + num, block_size)
        if not prefix:  # without sharing, no block is held twice
            held = [b for bl in kv.blocks.values() for b in bl]
            assert len(held) == len(set(held))
        assert 0 not in {b for bl in kv.blocks.values() for b in bl}  # null block never handed out
        if not asynchronous:
            if not out.is_empty:
                update(out)
            continue
        if in_flight is not None:
            update(in_flight)
        in_flight = None if out.is_empty else out
    if in_flight is not None:   # its rows all finished meanwhile (the extra token of each is dropped)
        update(in_flight)
    assert sched.num_in_flight == 0
    for _, _, req in reqs:
        assert req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED), req.status
        if req.status == RequestStatus.FINISHED_LENGTH:
            assert len(req.output_token_ids) == req.max_tokens
    assert kv.pool.num_free_blocks == num_blocks - 1
    assert not kv.blocks
    assert (kv.pool.ref_cnt[1:] == 0).all()
    assert sched.slots.num_free == max_seqs
