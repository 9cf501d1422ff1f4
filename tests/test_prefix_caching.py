"""Prefix caching through the engine (`LLM(...)`, backend "cpu", float32, tiny model).

- a batch whose prompts share a long prefix computes it once (hit counter),
  with the same outputs as with caching off;
- a property test drives random prompts with shared prefixes, aborts and
  small KV pools through the engine: no block leaks, ref counts return to
  zero, cached blocks are reused and give the same tokens as a fresh compute.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from polyrunner import LLM, SamplingParams
from tiny_models import kv_bytes

BLOCK = 16
MAX_NEW = 6


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("qwen2")



def _llm(folder, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 8)
    return LLM(str(folder), backend="cpu", dtype="float32", block_size=BLOCK, **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_leak(llm: LLM) -> None:
    eng = llm.engine
    pool = eng.kv.pool
    assert not eng.has_unfinished_requests()
    assert not eng.kv.blocks, "a request still holds blocks"
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert (pool.ref_cnt[1:] == 0).all() and pool.ref_cnt[0] == 1
    # every cached block is free and maps back to its key
    free = set(pool.free_blocks())
    assert len(free) == pool.num_free_blocks
    for key, block in pool._block_of.items():
        assert pool._key_of[block] == key and block in free


def _assert_ref_counts(eng) -> None:
    """Each block's ref count is the number of requests holding it; held blocks are not free."""
    pool = eng.kv.pool
    counts = np.zeros(pool.num_blocks, np.int64)
    for blocks in eng.kv.blocks.values():
        np.add.at(counts, blocks, 1)
    assert counts[0] == 0, "the null block was handed out"
    assert (counts[1:] == pool.ref_cnt[1:]).all()
    held = set(np.flatnonzero(counts).tolist())
    assert not held & set(pool.free_blocks()), "a held block is on a free list"
    assert len(held) + pool.num_free_blocks == pool.num_usable_blocks


RNG = np.random.default_rng(7)
PREFIX = RNG.integers(3, 512, size=5 * BLOCK + 3).tolist()     # 83 tokens: 5 full blocks + 3
SUFFIXES = [RNG.integers(3, 512, size=int(k)).tolist() for k in (1, 4, 9, 13, 20, 31)]
SHARED = [PREFIX + s for s in SUFFIXES]


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, seed=300 + i, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model):
    folder, _ = model
    llm = _llm(folder, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in SHARED], [_params(i) for i in range(len(SHARED))],
                        use_tqdm=False)
    assert llm.engine.kv.pool.stats.hit_tokens == 0
    assert llm.engine.kv.pool.num_cached_blocks() == 0
    _assert_no_leak(llm)
    return _tokens(outs)


@pytest.mark.parametrize("chunk", [None, 32])
def test_shared_prefix_computed_once_in_one_batch(model, reference, chunk):
    folder, _ = model
    kw = {} if chunk is None else dict(max_num_batched_tokens=chunk)
    llm = _llm(folder, **kw)
    eng = llm.engine
    computed = []
    original = eng.runner.execute

    def execute(so):
        computed.append(so.total_num_tokens)
        return original(so)

    eng.runner.execute = execute
    outs = llm.generate([{"prompt_token_ids": p} for p in SHARED], [_params(i) for i in range(len(SHARED))],
                        use_tqdm=False)
    assert _tokens(outs) == reference
    stats = eng.kv.pool.stats
    full_prefix = (len(PREFIX) // BLOCK) * BLOCK
    # every prompt but the first finds the prefix's full blocks cached
    assert stats.hit_tokens == (len(SHARED) - 1) * full_prefix
    assert [o.num_cached_tokens for o in outs] == [0] + [full_prefix] * (len(SHARED) - 1)
    total_prompt = sum(len(p) for p in SHARED)
    assert sum(computed) == total_prompt - stats.hit_tokens + len(SHARED) * (MAX_NEW - 1)
    _assert_no_leak(llm)

    # the same batch again: every full block of every prompt is a hit now, same tokens
    before = stats.hit_tokens
    again = llm.generate([{"prompt_token_ids": p} for p in SHARED], [_params(i) for i in range(len(SHARED))],
                         use_tqdm=False)
    assert _tokens(again) == reference
    assert stats.hit_tokens - before == sum(((len(p) - 1) // BLOCK) * BLOCK for p in SHARED)
    _assert_no_leak(llm)


def test_prefix_hit_after_decode_blocks(model):
    """Blocks filled by generated tokens are cached too: a prompt that continues an
    earlier prompt + output hits them, and gives the tokens a fresh compute gives."""
    folder, _ = model
    llm = _llm(folder)
    sp = SamplingParams(temperature=0, max_tokens=2 * BLOCK, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": SHARED[0]}, sp, use_tqdm=False)[0]
    follow = SHARED[0] + first.outputs[0].token_ids + [7, 8, 9]
    before = llm.engine.kv.pool.stats.hit_tokens
    out = llm.generate({"prompt_token_ids": follow}, sp, use_tqdm=False)[0]
    hit = llm.engine.kv.pool.stats.hit_tokens - before
    assert hit == ((len(follow) - 1) // BLOCK) * BLOCK  # every full block, decode-filled ones too
    fresh = _llm(folder, enable_prefix_caching=False).generate({"prompt_token_ids": follow}, sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == fresh.outputs[0].token_ids
    _assert_no_leak(llm)


def test_caching_off_never_hits(model, reference):
    folder, _ = model
    llm = _llm(folder, enable_prefix_caching=False)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in SHARED], [_params(i) for i in range(len(SHARED))],
                            use_tqdm=False)
        assert _tokens(outs) == reference
    assert llm.engine.kv.pool.stats.hit_tokens == 0
    assert all(o.num_cached_tokens == 0 for o in outs)
    _assert_no_leak(llm)


# ---- property: random prompts, shared prefixes, aborts, small pools --------------------
FAMILIES = [np.random.default_rng(100 + f).integers(3, 512, size=70).tolist() for f in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POOLS = {"tiny": (6, 16), "small": (10, 32)}  # usable blocks 5 and 9; token budget per step


@pytest.fixture(scope="module")
def engines(model):
    folder, hf = model
    return {name: _llm(folder, kv_cache_memory_bytes=kv_bytes(hf, n, BLOCK), max_num_seqs=4,
                       max_num_batched_tokens=budget)
            for name, (n, budget) in POOLS.items()}


@pytest.fixture(scope="module")
def fresh_greedy(model):
    """Greedy tokens of a prompt computed with no cache at all (memoised)."""
    llm = _llm(model[0], enable_prefix_caching=False)
    memo: dict[tuple[int, ...], list[int]] = {}

    def get(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            memo[key] = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        return memo[key]

    return get


request_st = st.tuples(
    st.integers(0, 2),             # prefix family
    st.integers(1, 64),            # shared prefix length
    st.lists(st.integers(3, 511), max_size=6),  # own suffix
    st.integers(1, 12),            # max_tokens
    st.one_of(st.none(), st.integers(0, 6)),    # abort at engine step
)


def _drive(llm: LLM, fresh_greedy, reqs) -> tuple[bool, bool, int]:
    """Run `reqs` (family, prefix length, suffix, max_tokens, abort step) through the
    engine, checking ref counts every step and everything after. Returns whether
    anything was preempted, whether the prefix cache hit, and how many were aborted."""
    eng = llm.engine
    for rid in list(eng.outputs._parents):  # a failed example leaves its requests behind
        eng.abort_request(rid)
    eng.step()
    _assert_no_leak(llm)
    ids, prompts, aborts = [], {}, {}
    preemptions, hits = eng.scheduler.num_preemptions, eng.kv.pool.stats.hit_tokens
    for fam, plen, suffix, max_tokens, abort_at in reqs:
        prompt = FAMILIES[fam][:plen] + suffix
        try:
            rid = eng.add_request({"prompt_token_ids": prompt}, GREEDY.model_copy(update={"max_tokens": max_tokens}))
        except ValueError as exc:  # more blocks than the whole pool: rejected up front
            assert "KV blocks" in str(exc)
            continue
        ids.append(rid)
        prompts[rid] = (prompt, max_tokens)
        if abort_at is not None:
            aborts.setdefault(abort_at, []).append(rid)
    finished = {}
    step = 0
    while eng.has_unfinished_requests():
        for rid in aborts.get(step, []):
            eng.abort_request(rid)
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
        assert step < 500, "no progress"
        _assert_ref_counts(eng)
    preempted = eng.scheduler.num_preemptions > preemptions
    hit = eng.kv.pool.stats.hit_tokens > hits
    eng.step()  # hands the last finished and aborted slots to the runner
    _assert_no_leak(llm)
    assert eng.runner.states.num_active == 0
    assert not eng.outputs._parents
    # completed requests got exactly the tokens a cache-free compute gives
    for rid, out in finished.items():
        prompt, max_tokens = prompts[rid]
        assert out.outputs[0].token_ids == fresh_greedy(prompt)[:max_tokens]

    # cached blocks are reusable: a prompt run twice finds all its full blocks the second time
    if finished:
        prompt, max_tokens = prompts[list(finished)[-1]]
        sp = GREEDY.model_copy(update={"max_tokens": max_tokens})
        for _ in range(2):
            before = eng.kv.pool.stats.hit_tokens
            out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == fresh_greedy(prompt)[:max_tokens]
            _assert_no_leak(llm)
        assert eng.kv.pool.stats.hit_tokens - before == (len(prompt) - 1) // BLOCK * BLOCK
        assert out.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK

    # and every block can still be handed out (cache entries are evicted, none is stuck)
    pool = eng.kv.pool
    blocks = pool.allocate(pool.num_usable_blocks)
    assert sorted(blocks) == list(range(1, pool.num_blocks))
    assert pool.num_cached_blocks() == 0
    pool.free(blocks)
    _assert_no_leak(llm)
    return preempted, hit, len(ids) - len(finished)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_st, min_size=2, max_size=8), pool=st.sampled_from(sorted(POOLS)))
def test_no_leak_with_aborts_and_small_pools(engines, fresh_greedy, reqs, pool):
    preempted, hit, aborted = _drive(engines[pool], fresh_greedy, reqs)
    event(f"preempted: {preempted}")
    event(f"prefix hits: {hit}")
    event(f"aborted: {aborted}")


def test_scenario_with_preemption_hits_and_aborts(engines, fresh_greedy):
    """A fixed stream that surely preempts, hits the cache and aborts running requests."""
    reqs = [(0, 17, [], 12, None), (1, 17, [], 12, 10), (2, 17, [], 12, None), (0, 17, [3], 12, None),
            (1, 17, [3], 12, 12), (2, 17, [3], 12, 2)]
    preempted, hit, aborted = _drive(engines["tiny"], fresh_greedy, reqs)
    assert preempted and hit and aborted >= 2
