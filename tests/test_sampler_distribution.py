"""Empirical distributions of the sampler vs independently computed ones.

Each case draws 20,000 samples (seeded, so pass/fail is deterministic) for a
fixed 20-token logits vector and runs a chi-square goodness-of-fit test
(p > 0.001) against the expected distribution, computed here in float64
numpy: softmax(logits / T) restricted to the top-k, then top-p (on the
top-k-renormalised distribution), then min-p set, renormalised. Excluded
tokens must never appear.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyrunner.sample import Sampler, SamplingState
from polyrunner.sampling_params import SamplingParams

V = 20
N = 20_000
LOGITS = np.random.default_rng(2024).normal(scale=1.2, size=V).astype(np.float32)


def expected_probs(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), dtype=bool)
    keep[order[: top_k if top_k > 0 else len(probs)]] = True
    if top_p < 1.0:
        renorm = np.where(keep, probs, 0.0) / probs[keep].sum()
        mass_above = np.concatenate([[0.0], np.cumsum(renorm[order])[:-1]])
        assert np.all(np.abs(mass_above - top_p) > 1e-3), "ambiguous test vector"
        keep[order[mass_above >= top_p]] = False
    if min_p > 0.0:
        keep &= probs >= min_p * probs[keep].max()
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution: Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    assert counts[probs == 0].sum() == 0, f"excluded tokens emitted: {np.flatnonzero((probs == 0) & (counts > 0))}"
    support = probs > 0
    exp = probs[support] * counts.sum()
    assert exp.min() >= 5, "test vector gives too few expected counts for chi-square"
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    return chi2_sf(stat, int(support.sum()) - 1)


def test_chi2_sf_known_values():
    # textbook critical values: P(chi2_1 > 3.841) = 0.05, P(chi2_10 > 23.209) = 0.01
    assert math.isclose(chi2_sf(3.841459, 1), 0.05, rel_tol=1e-4)
    assert math.isclose(chi2_sf(23.209251, 10), 0.01, rel_tol=1e-4)
    assert math.isclose(chi2_sf(2.0, 2), math.exp(-1.0), rel_tol=1e-9)


def draw_batch(params: SamplingParams, n: int = N, seed: int = 0) -> np.ndarray:
    """n draws as one batch of n identical rows, global RNG seeded."""
    state = SamplingState(n, V, torch.device("cpu"))
    for r in range(n):
        state.add_row(r, params, None)
    ones = np.ones(n, dtype=np.int32)
    meta = state.make_metadata(np.arange(n), np.zeros((n, 2), dtype=np.int32), ones, ones)
    torch.manual_seed(seed)
    logits = torch.from_numpy(LOGITS).expand(n, V).contiguous()
    tokens = Sampler()(logits, meta).sampled_token_ids.numpy()
    return np.bincount(tokens, minlength=V)


CASES = [
    dict(),
    dict(temperature=0.7),
    dict(temperature=1.6),
    dict(top_k=5),
    dict(top_p=0.8),
    dict(min_p=0.1),
    dict(temperature=1.3, top_k=8, top_p=0.7),
    dict(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("kw", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "plain" for c in CASES])
def test_distribution_matches(kw):
    counts = draw_batch(SamplingParams(**kw))
    probs = expected_probs(LOGITS, **kw)
    assert chi2_pvalue(counts, probs) > 1e-3


def test_filters_really_exclude_tokens():
    # the filtered cases above exclude a good part of the vocabulary
    assert (expected_probs(LOGITS, top_k=5) > 0).sum() == 5
    assert 2 < (expected_probs(LOGITS, top_p=0.8) > 0).sum() < V - 3
    assert 2 < (expected_probs(LOGITS, min_p=0.1) > 0).sum() < V - 3


def test_chi2_detects_a_wrong_distribution():
    # power check: temperature 0.7 samples are clearly not softmax(logits)
    counts = draw_batch(SamplingParams(temperature=0.7))
    assert chi2_pvalue(counts, expected_probs(LOGITS)) < 1e-6


def test_per_request_generator_distribution():
    """One seeded request, drawn step after step from its own generator."""
    steps = 4000
    state = SamplingState(2, V, torch.device("cpu"))
    state.add_row(0, SamplingParams(seed=11, top_k=10), torch.Generator().manual_seed(11))
    state.add_row(1, SamplingParams(temperature=0.0), None)
    ones = np.ones(2, dtype=np.int32)
    meta = state.make_metadata(np.arange(2), np.zeros((2, 2), dtype=np.int32), ones, ones)
    assert list(meta.generators) == [0]
    logits = torch.from_numpy(LOGITS).expand(2, V).contiguous()
    sampler = Sampler()
    tokens = np.array([int(sampler(logits, meta).sampled_token_ids[0]) for _ in range(steps)])
    counts = np.bincount(tokens, minlength=V)
    assert chi2_pvalue(counts, expected_probs(LOGITS, top_k=10)) > 1e-3


def test_mixed_greedy_rows_in_random_batch():
    n = 10_000
    state = SamplingState(n, V, torch.device("cpu"))
    for r in range(n):
        state.add_row(r, SamplingParams(temperature=0.0 if r % 4 == 0 else 1.0), None)
    ones = np.ones(n, dtype=np.int32)
    meta = state.make_metadata(np.arange(n), np.zeros((n, 2), dtype=np.int32), ones, ones)
    torch.manual_seed(3)
    tokens = Sampler()(torch.from_numpy(LOGITS).expand(n, V).contiguous(), meta).sampled_token_ids.numpy()
    assert np.all(tokens[::4] == int(np.argmax(LOGITS)))
    random_rows = np.delete(tokens, np.arange(0, n, 4))
    assert chi2_pvalue(np.bincount(random_rows, minlength=V), expected_probs(LOGITS)) > 1e-3
