"""Sampler and SamplingState: processed logits vs hand-computed vectors, seeds,
row moves, logprobs, and a property test of the top-k/top-p masks.

Expected values are written out by hand or computed independently with numpy
in float64; nothing is compared with another output of the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from polyrunner.sample import (
    LogprobsLists,
    Sampler,
    SamplingState,
    apply_logits_processors,
    apply_min_p,
    apply_top_k_top_p,
    compute_prompt_logprobs,
)
from polyrunner.sampling_params import SamplingParams
from tolerances import assert_close_ulp, log_softmax_reference

CPU = torch.device("cpu")
NEG_INF = float("-inf")
MAX_LEN = 32


class Batch:
    """A tiny stand-in for the runner's RequestStates: token rows by slot + the sampling state."""

    def __init__(self, max_reqs: int, vocab: int) -> None:
        self.state = SamplingState(max_reqs, vocab, CPU)
        self.token_ids = np.zeros((max_reqs, MAX_LEN), dtype=np.int32)
        self.num_prompt = np.zeros(max_reqs, dtype=np.int32)
        self.num_tokens = np.zeros(max_reqs, dtype=np.int32)
        self.num_reqs = 0

    def add(self, row, params, prompt=(0,), output=(), generator=None, bad_words=None,
            eos=frozenset()):
        toks = list(prompt) + list(output)
        self.token_ids[row, :len(toks)] = toks
        self.num_prompt[row] = len(prompt)
        self.num_tokens[row] = len(toks)
        self.state.add_row(row, params, generator, bad_words, eos_token_ids=eos)
        self.num_reqs = max(self.num_reqs, row + 1)

    def append(self, row, token):
        self.token_ids[row, self.num_tokens[row]] = token
        self.num_tokens[row] += 1

    def meta(self, discard=None, idx_mapping=None):
        idx = np.arange(self.num_reqs) if idx_mapping is None else np.asarray(idx_mapping)
        return self.state.make_metadata(idx, self.token_ids, self.num_prompt, self.num_tokens, discard)


def processed(batch: Batch, logits) -> np.ndarray:
    x = torch.tensor(np.array(logits), dtype=torch.float32)
    return apply_logits_processors(x, batch.meta()).numpy()


GREEDY = dict(temperature=0.0)
L6 = [2.0, -1.0, 0.5, 3.0, -0.5, 0.0]


# ---- metadata shape ---------------------------------------------------------
def test_plain_batch_uses_no_optional_feature():
    b = Batch(4, 6)
    b.add(0, SamplingParams())
    b.add(1, SamplingParams(temperature=0.5))
    m = b.meta()
    assert not m.all_greedy and m.all_random and m.is_greedy is None
    for name in ("top_k", "top_p", "min_p", "allowed_token_ids_mask", "bad_words_rows",
                 "logit_bias_rows", "min_tokens_rows", "penalty_rows", "max_num_logprobs"):
        assert getattr(m, name) is None, name
    assert m.generators == {}
    np.testing.assert_allclose(m.temperature.numpy(), [1.0, 0.5])
    x = torch.randn(2, 6)
    assert apply_logits_processors(x, m) is x


def test_greedy_rows_ignore_top_k_and_all_greedy_skips_temperature():
    b = Batch(2, 6)
    b.add(0, SamplingParams(temperature=0.0, top_k=2, top_p=0.5, seed=3))
    m = b.meta()
    assert m.all_greedy and m.temperature is None and m.top_k is None and m.top_p is None
    assert m.generators == {}


# ---- logits processors vs hand-computed vectors ----------------------------
def test_allowed_token_ids():
    b = Batch(3, 6)
    b.add(0, SamplingParams(allowed_token_ids=[1, 4], **GREEDY))
    b.add(1, SamplingParams(**GREEDY))
    out = processed(b, [L6, L6])
    np.testing.assert_array_equal(out[0], [NEG_INF, -1.0, NEG_INF, NEG_INF, -0.5, NEG_INF])
    np.testing.assert_array_equal(out[1], L6)


def test_bad_words_single_and_multi_token():
    b = Batch(4, 8)
    words = [[3], [5, 6], [1, 2, 7]]
    # row 0: output ends with 5 -> 6 blocked; [1, 2] is not the output tail -> 7 free
    b.add(0, SamplingParams(**GREEDY), prompt=[1, 2], output=[4, 5], bad_words=words)
    # row 1: output ends with [1, 2] -> 7 blocked; 6 free
    b.add(1, SamplingParams(**GREEDY), prompt=[0], output=[5, 1, 2], bad_words=words)
    # row 2: the prompt ends with 5 and [1, 2]... but no output yet: only 3 blocked
    b.add(2, SamplingParams(**GREEDY), prompt=[1, 2, 5], output=[], bad_words=words)
    # row 3: output [2] with prompt [..., 1]: prefix spans the prompt -> not blocked
    b.add(3, SamplingParams(**GREEDY), prompt=[0, 1], output=[2], bad_words=words)
    x = np.arange(8, dtype=np.float32)
    out = processed(b, [x] * 4)
    exp = np.tile(x, (4, 1))
    exp[:, 3] = NEG_INF
    exp[0, 6] = NEG_INF
    exp[1, 7] = NEG_INF
    np.testing.assert_array_equal(out, exp)


def test_logit_bias():
    b = Batch(2, 6)
    b.add(0, SamplingParams(logit_bias={0: -100.0, 4: 2.5, 5: 0.25}, **GREEDY))
    b.add(1, SamplingParams(**GREEDY))
    out = processed(b, [L6, L6])
    np.testing.assert_allclose(out[0], [-98.0, -1.0, 0.5, 3.0, 2.0, 0.25])
    np.testing.assert_array_equal(out[1], L6)


def test_min_tokens_masks_stop_and_eos_until_reached():
    b = Batch(4, 6)
    eos = frozenset({5})
    # 1 output token, min_tokens 2: stop id 2 and EOS 5 masked
    b.add(0, SamplingParams(min_tokens=2, stop_token_ids=[2], **GREEDY), output=[1], eos=eos)
    # ignore_eos does not lift the min_tokens mask on EOS
    b.add(1, SamplingParams(min_tokens=2, ignore_eos=True, **GREEDY), output=[], eos=eos)
    # reached: nothing masked
    b.add(2, SamplingParams(min_tokens=2, stop_token_ids=[2], **GREEDY), output=[1, 1], eos=eos)
    # no min_tokens: nothing masked
    b.add(3, SamplingParams(stop_token_ids=[2], **GREEDY), output=[], eos=eos)
    out = processed(b, [L6] * 4)
    np.testing.assert_array_equal(out[0], [2.0, -1.0, NEG_INF, 3.0, -0.5, NEG_INF])
    np.testing.assert_array_equal(out[1], [2.0, -1.0, 0.5, 3.0, -0.5, NEG_INF])
    np.testing.assert_array_equal(out[2], L6)
    np.testing.assert_array_equal(out[3], L6)
    # after one more token row 0 reaches min_tokens
    b.append(0, 1)
    np.testing.assert_array_equal(processed(b, [L6] * 4)[0], L6)


def test_penalties_hand_computed():
    b = Batch(3, 6)
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3, **GREEDY)
    b.add(0, p, prompt=[0, 1], output=[2, 2, 3])
    b.token_ids[0, 5:10] = 4  # stale tokens past num_tokens must not count
    b.add(1, SamplingParams(**GREEDY), prompt=[0, 1, 2, 3], output=[3])
    out = processed(b, [L6, L6])
    # seen = {0, 1, 2, 3}; counts: 2 -> 2, 3 -> 1
    # 0:  2.0 / 2                   = 1.0
    # 1: -1.0 * 2                   = -2.0
    # 2:  0.5 / 2 - 0.5*2 - 0.3     = -1.05
    # 3:  3.0 / 2 - 0.5*1 - 0.3     = 0.7
    # 4: -0.5 (unseen), 5: 0.0 (unseen)
    # float32: the penalties rounded to float32 and <= 3 operations, each within 1 ulp of the result
    assert_close_ulp(torch.from_numpy(out[0]), torch.tensor([1.0, -2.0, -1.05, 0.7, -0.5, 0.0], dtype=torch.float64),
                     torch.float32, ulps=4)
    np.testing.assert_array_equal(out[1], L6)


def test_penalties_prompt_only_gets_repetition_not_frequency():
    b = Batch(1, 6)
    b.add(0, SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0,
                            **GREEDY), prompt=[3, 4, 5], output=[])
    out = processed(b, [L6])
    # 3: 3.0/1.5 = 2.0; 4: -0.5*1.5 = -0.75; 5: 0.0*1.5 = 0; no output -> no freq/presence
    assert_close_ulp(torch.from_numpy(out[0]), torch.tensor([2.0, -1.0, 0.5, 2.0, -0.75, 0.0], dtype=torch.float64),
                     torch.float32, ulps=2)   # the penalty rounded to float32, one division


def test_penalties_ignore_async_placeholders():
    b = Batch(1, 6)
    b.add(0, SamplingParams(presence_penalty=1.0, **GREEDY), prompt=[0], output=[1, -1])
    out = processed(b, [L6])
    np.testing.assert_allclose(out[0], [2.0, -2.0, 0.5, 3.0, -0.5, 0.0])


def test_processor_order_bias_before_repetition_and_input_untouched():
    b = Batch(1, 4)
    b.add(0, SamplingParams(logit_bias={1: 1.0}, repetition_penalty=2.0, allowed_token_ids=[0, 1, 2],
                            **GREEDY), prompt=[1, 3], output=[])
    x = torch.tensor([[0.0, 1.0, 4.0, 9.0]])
    before = x.clone()
    out = apply_logits_processors(x, b.meta()).numpy()
    # token 1: (1 + 1) / 2 = 1.0 (bias first, then penalty); token 3 not allowed
    np.testing.assert_allclose(out[0], [0.0, 1.0, 4.0, NEG_INF])
    assert torch.equal(x, before)


def test_idx_mapping_metadata():
    """Metadata row i is slot idx_mapping[i]."""
    b = Batch(5, 6)
    b.add(0, SamplingParams(logit_bias={5: 50.0}, **GREEDY))
    b.add(1, SamplingParams(presence_penalty=1.0, **GREEDY), output=[5])
    b.add(2, SamplingParams(logit_bias={0: 1.0}, **GREEDY))
    b.add(3, SamplingParams(min_tokens=3, **GREEDY), output=[1], eos=frozenset({4}))
    b.add(4, SamplingParams(presence_penalty=1.0, allowed_token_ids=[0, 1, 2], seed=3),
          output=[1], bad_words=[[1, 2]])
    m = b.meta(np.zeros(3, bool), idx_mapping=[2, 3, 4])
    assert m.num_reqs == 3 and list(m.generators) == [2] and m.is_greedy.tolist() == [True, True, False]
    out = apply_logits_processors(torch.tensor([L6] * 3), m).numpy()
    np.testing.assert_allclose(out, [
        [3.0, -1.0, 0.5, 3.0, -0.5, 0.0],             # bias on token 0
        [2.0, -1.0, 0.5, 3.0, NEG_INF, 0.0],          # EOS masked (1 of 3 tokens)
        [2.0, -2.0, NEG_INF, NEG_INF, NEG_INF, NEG_INF],  # allowed {0,1,2}, bad [1,2], presence on 1
    ])


# ---- greedy / mixed ---------------------------------------------------------
def test_greedy_argmax_of_processed_logits_first_index_on_ties():
    b = Batch(3, 6)
    b.add(0, SamplingParams(**GREEDY))
    b.add(1, SamplingParams(logit_bias={1: 10.0}, **GREEDY))
    b.add(2, SamplingParams(**GREEDY))
    logits = torch.tensor([L6, L6, [0.0, 7.0, 1.0, 7.0, 7.0, 2.0]])
    out = Sampler()(logits, b.meta())
    assert out.sampled_token_ids.tolist() == [3, 1, 1]
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(0)
    b = Batch(8, 10)
    for r in range(8):
        b.add(r, SamplingParams(temperature=0.0 if r % 2 else 5.0))
    logits = torch.randn(8, 10)
    seen_random = set()
    for _ in range(50):
        out = Sampler()(logits, b.meta()).sampled_token_ids
        assert torch.equal(out[1::2], logits[1::2].argmax(-1))
        seen_random.add(int(out[0]))
    assert len(seen_random) > 3  # temperature 5 really samples


def test_top_k_ties_exact_and_deterministic():
    # tokens 1, 2, 3 tie; k = 2 keeps exactly the two lowest ids among the tie
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]]).repeat(3000, 1)
    b = Batch(3000, 5)
    for r in range(3000):
        b.add(r, SamplingParams(top_k=2))
    torch.manual_seed(1)
    out = Sampler()(logits, b.meta()).sampled_token_ids
    assert set(out.tolist()) == {1, 2}


def test_top_p_ties_exact():
    # uniform over 4 (probs exactly 0.25): p = 0.5 keeps the two lowest ids
    out = apply_top_k_top_p(torch.zeros(1, 4), None, torch.tensor([0.5]))
    np.testing.assert_array_equal(out[0].numpy(), [0.0, 0.0, NEG_INF, NEG_INF])
    out = apply_top_k_top_p(torch.zeros(1, 4), None, torch.tensor([0.51]))
    np.testing.assert_array_equal(out[0].numpy(), [0.0, 0.0, 0.0, NEG_INF])


def test_top_p_renormalises_after_top_k():
    # probs 0.4, 0.3, 0.2, 0.1; top-k 2 -> 4/7, 3/7; top-p 0.5 keeps only the first
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]


def _ref_keep(x: np.ndarray, k: int, p: float) -> set[int] | None:
    """Independent float64 top-k-then-top-p keep set; None when a mass is too close to p."""
    vocab = len(x)
    order = np.argsort(-x, kind="stable")  # ties: lower id first
    kk = vocab if k <= 0 or k >= vocab else k
    top = order[:kk]
    if p >= 1.0:
        return {int(t) for t in top}
    w = np.exp(x[top] - x[top].max())
    w /= w.sum()
    before = np.concatenate([[0.0], np.cumsum(w)[:-1]])
    if np.any(np.abs(before - p) < 1e-4):
        return None
    return {int(t) for t, b in zip(top, before) if b < p}


@st.composite
def topk_topp_rows(draw):
    """1-4 rows over one vocab of 2-12: (logits with frequent ties, k in [0, V+2], p)."""
    vocab = draw(st.integers(2, 12))
    logit = st.one_of(st.floats(-6, 6, width=32), st.sampled_from([0.0, 1.0, 2.0]))
    return [(draw(st.lists(logit, min_size=vocab, max_size=vocab)),
             draw(st.integers(0, vocab + 2)),
             draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0))))
            for _ in range(draw(st.integers(1, 4)))]


@settings(max_examples=250, deadline=None)
@given(topk_topp_rows())
def test_property_top_k_top_p_mask(rows):
    x = np.array([r[0] for r in rows], dtype=np.float32)
    ks = torch.tensor([r[1] if 0 < r[1] < x.shape[1] else x.shape[1] for r in rows])
    ps = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    refs = [_ref_keep(x[i].astype(np.float64), rows[i][1], float(ps[i])) for i in range(len(rows))]
    assume(all(r is not None for r in refs))
    out = apply_top_k_top_p(torch.from_numpy(x), ks, ps).numpy()
    for i, ref in enumerate(refs):
        kept = set(np.flatnonzero(np.isfinite(out[i])).tolist())
        assert kept == ref
        np.testing.assert_array_equal(out[i][list(ref)], x[i][list(ref)])  # values untouched


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0, width=32), min_size=2, max_size=12), st.floats(0.0, 1.0))
def test_property_min_p(probs, min_p):
    probs = np.array(probs, dtype=np.float32)
    assume(probs.max() > 0)
    thr = float(min_p) * probs.max().astype(np.float64)
    assume(np.all(np.abs(probs.astype(np.float64) - thr) > 1e-6))
    out = apply_min_p(torch.from_numpy(probs.copy()).unsqueeze(0), torch.tensor([min_p], dtype=torch.float32))
    expected = np.where(probs.astype(np.float64) >= thr, probs, 0.0)
    np.testing.assert_array_equal(out[0].numpy(), expected.astype(np.float32))


def test_min_p_boundary_is_inclusive():
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.125]])  # exact in float32
    out = apply_min_p(probs.clone(), torch.tensor([0.5]))
    np.testing.assert_array_equal(out[0].numpy(), [0.5, 0.25, 0.25, 0.0])
    out = apply_min_p(probs.clone(), torch.tensor([1.0]))
    np.testing.assert_array_equal(out[0].numpy(), [0.5, 0.0, 0.0, 0.0])


# ---- seeds, discard, row moves ---------------------------------------------
V_SEED = 40
SEEDED = SamplingParams(seed=1234, temperature=0.9, top_k=25, top_p=0.95)


def _step_logits(step: int, vocab: int = V_SEED) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(1000 + step).normal(size=vocab).astype(np.float32)) * 2


def _run(layout: list[SamplingParams | None], slot: int, steps: int, *, pass_generator: bool,
         orders: dict[int, list[int]] | None = None, discard_steps=()) -> list[int]:
    """Sample `steps` steps; return the tokens of the request in `slot`. `orders[k]`:
    from step k on, the batch gathers these slots in this order (idx_mapping)."""
    b = Batch(len(layout), V_SEED)
    for r, p in enumerate(layout):
        if p is not None:
            gen = None
            if pass_generator and p.seed is not None:
                gen = torch.Generator().manual_seed(p.seed)
            b.add(r, p, generator=gen)
    b.num_reqs = len(layout)
    noise = torch.Generator().manual_seed(99)
    tokens, real = [], 0
    idx = list(range(len(layout)))
    for step in range(steps):
        if orders and step in orders:
            idx = orders[step]
        cur = idx.index(slot)
        logits = torch.randn(len(idx), V_SEED, generator=noise)
        # the k-th kept step sees the same logits in every run; discarded steps see others
        logits[cur] = _step_logits(real if step not in discard_steps else 10_000 + step)
        discard = np.zeros(len(idx), dtype=bool)
        if step in discard_steps:
            discard[cur] = True
        torch.manual_seed(step * 7 + len(layout))  # the global RNG differs between runs
        out = Sampler()(logits, b.meta(discard, idx_mapping=idx)).sampled_token_ids
        if step not in discard_steps:
            tokens.append(int(out[cur]))
            real += 1
    return tokens


OTHERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.3),
    SamplingParams(seed=5, top_p=0.5),
    SamplingParams(top_k=3, min_p=0.2, repetition_penalty=1.3),
]


def test_seed_same_tokens_whatever_batch_and_row():
    alone = _run([SEEDED], 0, 30, pass_generator=True)
    crowded = _run([OTHERS[0], OTHERS[1], OTHERS[2], SEEDED, OTHERS[3]], 3, 30, pass_generator=True)
    auto_gen = _run([OTHERS[3], SEEDED], 1, 30, pass_generator=False)
    assert alone == crowded == auto_gen
    other_seed = _run([SEEDED.model_copy(update={"seed": 4321})], 0, 30, pass_generator=True)
    assert other_seed != alone  # the test can fail


def test_seed_survives_any_batch_row():
    """A seeded request samples the same tokens whichever batch row its slot lands in."""
    alone = _run([SEEDED], 0, 30, pass_generator=True)
    layout = [OTHERS[0], OTHERS[1], OTHERS[3], SEEDED, OTHERS[2]]
    reordered = _run(layout, 3, 30, pass_generator=True,
                     orders={8: [3, 0, 1], 15: [0, 4, 2, 3], 22: [4, 3, 1, 0, 2]})
    assert reordered == alone


def test_discarded_rows_do_not_advance_their_generator():
    alone = _run([SEEDED], 0, 20, pass_generator=True)
    # three partial-prefill steps first (different logits, sample thrown away)
    with_discards = _run([OTHERS[1], SEEDED], 1, 23, pass_generator=True, discard_steps=(0, 1, 2))
    assert with_discards == alone
    # and directly: the generator state is unchanged by a discarded step
    b = Batch(2, V_SEED)
    gen = torch.Generator().manual_seed(7)
    b.add(0, SamplingParams(seed=7), generator=gen)
    b.add(1, SamplingParams(seed=8))
    state = gen.get_state().clone()
    meta = b.meta(np.array([True, False]))
    assert 0 not in meta.generators and 1 in meta.generators
    Sampler()(torch.randn(2, V_SEED), meta)
    assert torch.equal(gen.get_state(), state)
    Sampler()(torch.randn(2, V_SEED), b.meta(np.array([False, False])))
    assert not torch.equal(gen.get_state(), state)


def test_params_stay_with_their_slot_in_any_batch_order():
    b = Batch(4, 8)
    g = torch.Generator().manual_seed(3)
    b.add(0, SamplingParams(temperature=0.0))
    b.add(1, SamplingParams(temperature=0.5, top_k=3, logit_bias={2: 1.0}), generator=None)
    b.add(3, SamplingParams(seed=3, allowed_token_ids=[1, 2], presence_penalty=0.5,
                            min_tokens=1, logprobs=2), generator=g, bad_words=[[7]],
          eos=frozenset({0}), output=[])
    s = b.state
    assert s.generators == {3: g} and s.params[2] is None
    b.num_reqs = 4
    m = b.meta(idx_mapping=[3, 1, 0])   # slot 2 is empty and not gathered
    np.testing.assert_array_equal(m.allowed_token_ids_mask[0].numpy(),
                                  [True, False, False, True, True, True, True, True])
    assert not m.allowed_token_ids_mask[1:].any()
    assert m.logit_bias_rows.tolist() == [1] and m.logit_bias_ids.tolist() == [2]
    assert m.penalty_rows.tolist() == [0]
    assert sorted(zip(m.min_tokens_rows.tolist(), m.min_tokens_ids.tolist())) == [(0, 0)]
    assert sorted(zip(m.bad_words_rows.tolist(), m.bad_words_ids.tolist())) == [(0, 7)]
    assert m.top_k.tolist() == [8, 3, 8] and m.num_logprobs.tolist() == [2, -1, -1]
    assert m.is_greedy.tolist() == [False, False, True] and list(m.generators) == [0]
    s.clear_row(3)
    assert s.generators == {} and s.params[3] is None and not s.has_allowed[3]
    m = b.meta(idx_mapping=[0, 1])
    assert m.allowed_token_ids_mask is None and m.penalty_rows is None and m.min_tokens_rows is None
    assert m.bad_words_rows is None and m.max_num_logprobs is None
    # a new request reusing a slot that held an allowed mask starts clean
    s.add_row(3, SamplingParams(allowed_token_ids=[5]), None)
    s.add_row(2, SamplingParams(allowed_token_ids=[6]), None)
    s.clear_row(3)
    s.add_row(3, SamplingParams(), None)
    m = b.meta()
    assert m.allowed_token_ids_mask[3].sum() == 0 and m.allowed_token_ids_mask[2].sum() == 7


def test_add_row_rejects_out_of_vocab_ids():
    s = SamplingState(2, 10, CPU)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        s.add_row(0, SamplingParams(allowed_token_ids=[10]), None)
    with pytest.raises(ValueError, match="bad_words_ids"):
        s.add_row(0, SamplingParams(), None, [[1, 10]])
    with pytest.raises(ValueError, match="eos_token_ids"):
        s.add_row(0, SamplingParams(min_tokens=2), None, eos_token_ids=frozenset({11}))
    with pytest.raises(IndexError):
        s.add_row(2, SamplingParams(), None)


# ---- logprobs ---------------------------------------------------------------
def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_are_raw_with_ranks_and_topk():
    vocab = 7
    logits = np.array([[0.5, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0],
                       [1.0, 0.0, -2.0, 4.0, 4.0, 0.5, 0.5]], dtype=np.float32)
    b = Batch(2, vocab)
    # row 0: greedy but token 4 is not allowed -> picks token 1 (first of the tied 2.0s)
    b.add(0, SamplingParams(allowed_token_ids=[0, 1, 2, 3], logprobs=3, **GREEDY))
    # row 1: only token 6 allowed -> picks 6, whose raw rank is 4 (3, 4 and 0 are greater)
    b.add(1, SamplingParams(allowed_token_ids=[6], logprobs=1, **GREEDY))
    out = Sampler()(torch.from_numpy(logits), b.meta())
    assert out.sampled_token_ids.tolist() == [1, 6]
    lp = out.logprobs
    assert lp.token_ids.shape == (2, 4) and lp.logprobs.dtype == torch.float32
    want, bound = log_softmax_reference(logits)
    assert lp.token_ids[:, 0].tolist() == [1, 6]
    assert lp.ranks.tolist() == [2, 4]  # row 0: only token 4 is strictly greater than 2.0
    assert lp.token_ids[0, 1:].tolist()[0] == 4 and set(lp.token_ids[0, 2:].tolist()) == {1, 2}
    assert set(lp.token_ids[1, 1:3].tolist()) == {3, 4} and lp.token_ids[1, 3].item() == 0
    for r in range(2):
        ids = lp.token_ids[r]
        assert_close_ulp(lp.logprobs[r], want[r, ids], ulps=0, abs_err=bound[r, ids])
    lists = lp.tolists()
    assert isinstance(lists, LogprobsLists)
    ids_all, _, ranks_all = lists
    assert ids_all[0][0] == 1 and lists[2] == ranks_all == [2, 4]
    ids, lps, rank = lists.row(1, b.meta().num_logprobs[1])
    assert ids[0] == 6 and len(ids) == len(lps) == 2 and rank == 4


def test_logprobs_k0_and_full_vocab():
    vocab = 5
    logits = torch.tensor([[0.1, 0.2, 3.0, -1.0, 0.0]])
    b = Batch(1, vocab)
    b.add(0, SamplingParams(logprobs=0, **GREEDY))
    lp = Sampler()(logits, b.meta()).logprobs
    assert lp.token_ids.tolist() == [[2]] and lp.ranks.tolist() == [1]
    want, bound = log_softmax_reference(logits)
    assert_close_ulp(lp.logprobs, want[:, [2]], ulps=0, abs_err=bound[:, [2]])
    b.add(0, SamplingParams(logprobs=-1, **GREEDY))
    lp = Sampler()(logits, b.meta()).logprobs
    assert lp.token_ids.tolist() == [[2, 2, 1, 0, 4, 3]]
    order = [2, 1, 0, 4, 3]   # by logit, descending
    assert_close_ulp(lp.logprobs[0, 1:], want[0, order], ulps=0, abs_err=bound[0, order])


def test_prompt_logprobs():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(5, 9)).astype(np.float32)
    targets = np.array([3, 0, 8, 8, 1])
    lp = compute_prompt_logprobs(torch.from_numpy(logits), torch.from_numpy(targets), 2)
    ref = _np_log_softmax(logits)
    want, bound = log_softmax_reference(logits)
    assert lp.token_ids[:, 0].tolist() == targets.tolist()
    rows = torch.arange(5)
    assert_close_ulp(lp.logprobs[:, 0], want[rows, targets], ulps=0, abs_err=bound[rows, targets])
    top2 = np.argsort(-ref, axis=1)[:, :2]
    np.testing.assert_array_equal(lp.token_ids[:, 1:].numpy(), top2)
    ranks = (ref > ref[np.arange(5), targets][:, None]).sum(1) + 1
    np.testing.assert_array_equal(lp.ranks.numpy(), ranks)
    assert compute_prompt_logprobs(torch.from_numpy(logits), torch.from_numpy(targets), -1).token_ids.shape == (5, 10)
    # a chunked prompt's chunks give the rows of the whole prompt
    parts = [compute_prompt_logprobs(torch.from_numpy(logits[lo:hi]), torch.from_numpy(targets[lo:hi]), 2)
             for lo, hi in ((0, 2), (2, 5))]
    assert torch.equal(torch.cat([p.token_ids for p in parts]), lp.token_ids)
    assert torch.equal(torch.cat([p.ranks for p in parts]), lp.ranks)
    np.testing.assert_allclose(torch.cat([p.logprobs for p in parts]).numpy(), lp.logprobs.numpy())


def test_sampler_never_writes_into_logits():
    b = Batch(2, 6)
    b.add(0, SamplingParams(top_k=2, top_p=0.7, min_p=0.1, temperature=0.7, logit_bias={1: 3.0},
                            repetition_penalty=1.2, logprobs=2), prompt=[1, 2])
    b.add(1, SamplingParams(**GREEDY))
    x = torch.randn(2, 6)
    before = x.clone()
    Sampler()(x, b.meta())
    assert torch.equal(x, before)


def test_never_emits_masked_token_even_with_extreme_temperature():
    vocab = 50
    b = Batch(500, vocab)
    for r in range(500):
        b.add(r, SamplingParams(temperature=100.0, top_k=5, allowed_token_ids=list(range(0, 50, 3))))
    logits = torch.from_numpy(np.random.default_rng(0).normal(size=(500, vocab)).astype(np.float32))
    allowed = np.arange(0, 50, 3)
    torch.manual_seed(0)
    out = Sampler()(logits, b.meta()).sampled_token_ids.numpy()
    for r in range(500):
        row = logits[r].numpy()[allowed]
        top5 = set(allowed[np.argsort(-row, kind="stable")[:5]].tolist())
        assert int(out[r]) in top5
