"""Speculative decoding keeps the target distribution: chi-square tests of the
rejection sampler against the exact target probabilities, and of the engine's
token at fixed output positions against the non-speculative engine; per-request
seeds stay reproducible. (scipy is not installed: the chi-square threshold is the
Wilson-Hilferty approximation of the 1 - 1e-4 quantile.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrunner import LLM, SamplingParams
from polyrunner.sample.rejection import rejection_sample, target_probs
from polyrunner.sample.sampler import apply_logits_processors
from polyrunner.sample.state import SamplingState

Z = 3.719   # standard normal 1 - 1e-4 quantile


def chi2_threshold(df: int) -> float:
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z * np.sqrt(h)) ** 3


def goodness_of_fit(samples: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, threshold) of samples against known probabilities (cells with
    expected count < 5 pooled)."""
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    expected = probs * len(samples)
    small = expected < 5
    assert counts[probs == 0].sum() == 0, "a token with probability 0 was drawn"
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, chi2_threshold(max(int(keep.sum()) - 1, 1))


def homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(statistic, threshold) of a two-sample chi-square test that `a` and `b` come
    from one distribution (categories with a pooled expected count < 10 merged)."""
    cats, inv = np.unique(np.concatenate([a, b]), return_inverse=True)
    ca = np.bincount(inv[:len(a)], minlength=len(cats)).astype(float)
    cb = np.bincount(inv[len(a):], minlength=len(cats)).astype(float)
    small = (ca + cb) < 10
    ca = np.append(ca[~small], ca[small].sum())
    cb = np.append(cb[~small], cb[small].sum())
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    tot = ca + cb
    ea, eb = tot * len(a) / (len(a) + len(b)), tot * len(b) / (len(a) + len(b))
    stat = float(((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum())
    return stat, chi2_threshold(max(len(tot) - 1, 1))


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8, min_p=0.02),
])
def test_rejection_sampler_matches_target(params):
    """Each position's token follows the target exactly: position 0 always; position 1
    given that draft 0 was accepted (then it is draft 1 or its replacement)."""
    from polyrunner.sampling_params import SamplingParams as SP
    V, R, k = 12, 24000, 2
    gen = torch.Generator().manual_seed(0)
    logits_rows = torch.randn(k + 1, V, generator=gen) * 1.5
    state = SamplingState(1, V, "cpu", default_generator=torch.Generator().manual_seed(1))
    state.add_row(0, SP(**params), None)
    slots = np.zeros(R * (k + 1), np.int64)
    tok = np.zeros((1, 8), np.int32)
    meta = state.make_metadata(slots, tok, np.ones(1, np.int32), np.ones(1, np.int32))
    p = target_probs(apply_logits_processors(logits_rows, meta), state.make_metadata(
        np.zeros(k + 1, np.int64), tok, np.ones(1, np.int32), np.ones(1, np.int32))).numpy().astype(np.float64)
    p /= p.sum(axis=1, keepdims=True)
    rng = np.random.default_rng(2)
    # drafts: half from a wrong distribution (uniform), half the target's likeliest token
    drafts = np.where(rng.random((R, k)) < 0.5, rng.integers(0, V, (R, k)), p[:k].argmax(axis=1)[None, :])
    tokens, num = rejection_sample(logits_rows.repeat(R, 1), meta, drafts, np.full(R, k),
                                   default_generator=state.default_generator)
    assert ((num >= 1) & (num <= k + 1)).all()
    stat, limit = goodness_of_fit(tokens[:, 0], p[0])
    assert stat < limit, (stat, limit)
    accepted0 = num >= 2                      # draft 0 accepted: position 1 exists, follows p[1]
    stat, limit = goodness_of_fit(tokens[accepted0, 1], p[1])
    assert stat < limit, (stat, limit)
    assert (tokens[accepted0, 0] == drafts[accepted0, 0]).all()
    bonus = num == k + 1                      # all accepted: the bonus follows p[k]
    if bonus.sum() > 200:
        stat, limit = goodness_of_fit(tokens[bonus, k], p[k])
        assert stat < limit, (stat, limit)


def test_chi_square_detects_a_biased_sampler():
    """The test above can fail: resampling from p itself (not the residual) after a
    rejection over-weights the draft token."""
    V, n = 8, 20000
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(V))
    draft = int(p.argmax())
    accept = rng.random(n) < p[draft]
    wrong = np.where(accept, draft, rng.choice(V, size=n, p=p))
    stat, limit = goodness_of_fit(wrong, p)
    assert stat > limit


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
MOTIF = [5, 77, 123, 300, 41]


def _tokens(folder, spec, params, copies: int, proposer=None) -> tuple[np.ndarray, object]:
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=64, seed=3, speculative_config=spec)
    if proposer is not None:
        llm.engine.runner.proposer = proposer
    outs = llm.generate([{"prompt_token_ids": MOTIF * 4}] * copies, params, use_tqdm=False)
    return np.array([c.token_ids for o in outs for c in o.outputs]), llm.engine.speculative_stats()


class _ContinuationProposer:
    """Proposes the greedy continuation (a draft the target often accepts at low
    temperature): exercises long accepted runs and bonus tokens."""

    def __init__(self, continuation: list[int], k: int) -> None:
        self.seq = np.array(continuation, np.int64)
        self.num_speculative_tokens = k

    def propose(self, token_ids, slots, num_tokens, max_drafts):
        n_out = num_tokens - len(MOTIF) * 4
        cols = np.minimum(n_out[:, None] + np.arange(self.num_speculative_tokens), len(self.seq) - 1)
        return self.seq[cols], np.minimum(max_drafts, np.maximum(len(self.seq) - n_out, 0))


@pytest.mark.parametrize("proposer", ["ngram", "continuation"])
def test_engine_token_distribution_at_fixed_positions(tiny_model_factory, proposer):
    folder, _ = tiny_model_factory("llama")
    params = SamplingParams(temperature=0.5, top_k=4, max_tokens=6, ignore_eos=True, n=50)
    base, _ = _tokens(folder, None, params, 24)
    custom = None
    if proposer == "continuation":
        greedy, _ = _tokens(folder, None, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), 1)
        custom = _ContinuationProposer(greedy[0].tolist(), 3)
    spec, stats = _tokens(folder, SPEC, params, 24, custom)
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens > 20
    for pos in (1, 3, 5):
        stat, limit = homogeneity(base[:, pos], spec[:, pos])
        assert stat < limit, (pos, stat, limit)


def test_seeded_requests_reproducible_under_speculation(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", speculative_config=SPEC)
    seeded = SamplingParams(temperature=0.5, top_k=4, max_tokens=12, ignore_eos=True, seed=1234)
    other = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": MOTIF * 4}
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([prompt, prompt, prompt], [other, seeded, other], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == mixed
