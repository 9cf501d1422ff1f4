"""The rounding-derived tolerances of tests/tolerances.py: right where they can be checked
exactly, met by correct computations, failed by the bugs they exist to catch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from tolerances import (
    assert_close_ulp,
    assert_detects_errors,
    assert_linear_close,
    attention_reference,
    dot_error_bound,
    gamma,
    log_softmax_reference,
    ulp,
    unit_roundoff,
)


def test_ulp_and_unit_roundoff_values():
    x = torch.tensor([1.0, 1.5, 0.3, -3.0, 2.0 ** -130, 0.0, float("inf")])
    assert ulp(x, torch.bfloat16).tolist() == [2.0 ** -7, 2.0 ** -7, 2.0 ** -9, 2.0 ** -6, 2.0 ** -133,
                                               2.0 ** -133, 0.0]
    assert ulp(x, torch.float32)[:4].tolist() == [2.0 ** -23, 2.0 ** -23, 2.0 ** -25, 2.0 ** -22]
    assert ulp(torch.tensor([1.0]), torch.float16).item() == 2.0 ** -10
    assert [unit_roundoff(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == [2.0 ** -8, 2.0 ** -11,
                                                                                          2.0 ** -24]
    # ulp is the distance to the next representable number
    v = torch.tensor([1.25, 3.0, 100.0, 0.007], dtype=torch.bfloat16)
    nxt = (v.view(torch.int16) + 1).view(torch.bfloat16)   # the next bfloat16 up (positive values)
    assert torch.equal((nxt.double() - v.double()), ulp(v, torch.bfloat16))
    assert gamma(10) == pytest.approx(10 * 2.0 ** -24, rel=1e-6)
    with pytest.raises(ValueError):
        gamma(1 << 30, torch.bfloat16)


def test_one_rounding_is_within_one_ulp_and_perturbations_fail():
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(10_000, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (10_000,),
                                                                                        generator=g)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rounded = exact.to(dtype)
        assert_close_ulp(rounded, exact, ulps=1)
        assert_close_ulp(rounded, exact, ulps=0.501)   # half an ulp (torch rounds float64 via float32)
        with pytest.raises(AssertionError, match="beyond"):
            assert_close_ulp(rounded, exact, ulps=0.2)    # not vacuous: some elements are ~half an ulp off
        assert_detects_errors(lambda y, dtype=dtype: assert_close_ulp(y, exact, dtype, ulps=1), rounded)   # 1% and sign
    wrong = exact.to(torch.bfloat16).double()
    wrong[1234] *= 1.01                                      # a single element 1% off
    with pytest.raises(AssertionError, match=r"1 of 10000 elements beyond.*worst at \(1234,\)"):
        assert_close_ulp(wrong, exact, torch.bfloat16, ulps=1)


def test_non_finite_values_must_match():
    ref = torch.tensor([1.0, float("nan"), float("-inf")], dtype=torch.float64)
    assert_close_ulp(torch.tensor([1.0, float("nan"), float("-inf")]), ref)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_ulp(torch.tensor([float("nan"), float("nan"), float("-inf")]), ref)
    with pytest.raises(AssertionError, match="infinities"):
        assert_close_ulp(torch.tensor([1.0, float("nan"), float("inf")]), ref)
    with pytest.raises(AssertionError, match="shape"):
        assert_close_ulp(torch.zeros(2), ref)


def test_assert_detects_errors_flags_a_vacuous_tolerance():
    x = torch.ones(8)
    with pytest.raises(AssertionError, match="1% too large"):
        assert_detects_errors(lambda y: assert_close_ulp(y, x.double(), torch.bfloat16, ulps=4), x)
    with pytest.raises(AssertionError, match="negated"):
        assert_detects_errors(lambda y: assert_close_ulp(y.abs(), x.double(), torch.bfloat16, ulps=1), x)


@pytest.mark.parametrize("K", [7, 576, 4096])
def test_dot_error_bound_holds_for_float32_and_catches_bfloat16_accumulation(K):
    """Float32 sums in two different orders meet the bound; a bfloat16 accumulator (the bug
    the bound exists for) does not."""
    g = torch.Generator().manual_seed(K)
    x = torch.randn(16, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(32, K, generator=g) / 8).to(torch.bfloat16)
    exact = x.double() @ w.double().T
    bound = dot_error_bound(x, w)
    forward = x.float() @ w.float().T
    backward = x.float().flip(-1) @ w.float().flip(-1).T
    blocked = sum(x[:, i:i + 32].float() @ w[:, i:i + 32].float().T for i in range(0, K, 32))
    for y in (forward, backward, blocked):
        assert_close_ulp(y, exact, torch.float32, ulps=0, abs_err=bound)
        assert_close_ulp(y.to(torch.bfloat16), exact, ulps=1, abs_err=bound)
    if K > 64:
        acc = torch.zeros(16, 32, dtype=torch.bfloat16)
        for i in range(K):
            acc = acc + x[:, i:i + 1] * w[:, i]        # products and sums rounded to bfloat16
        with pytest.raises(AssertionError):
            assert_close_ulp(acc, exact, ulps=1, abs_err=bound)
    assert_linear_close(forward.to(torch.bfloat16), x, w)
    with pytest.raises(AssertionError):   # one weight row off by 1%: its outputs move by ~1%
        w2 = w.clone()
        w2[3] = (w2[3].double() * 1.01).to(torch.bfloat16)
        assert_linear_close((x.float() @ w2.float().T).to(torch.bfloat16), x, w)


def _one_request(L: int, n_q: int, heads: int, kv_heads: int, D: int, block_size: int, seed: int,
                 dtype: torch.dtype):
    """One request: n_q new tokens at the end of an L-token context, on consecutive blocks 1.."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-L // block_size)
    tables = np.arange(1, nb + 1, dtype=np.int32)[None]
    pos = np.arange(L - n_q, L)
    slots = tables[0, pos // block_size].astype(np.int64) * block_size + pos % block_size
    qsl, seq_lens = np.array([0, n_q], np.int32), np.array([L], np.int32)
    t = torch.from_numpy
    meta = AttentionMetadata(num_actual_tokens=n_q, num_reqs=1, num_decodes=int(n_q == 1), max_query_len=n_q,
                             max_seq_len=L, query_start_loc=t(qsl), seq_lens=t(seq_lens), block_tables=t(tables),
                             slot_mapping=t(slots), positions=t(pos), token_to_req=t(np.zeros(n_q, np.int32)),
                             query_start_loc_np=qsl, seq_lens_np=seq_lens)
    q = torch.randn(n_q, heads, D, generator=g).to(dtype)
    k, v = (torch.randn(n_q, kv_heads, D, generator=g).to(dtype) for _ in range(2))
    cache = torch.randn(2, nb + 1, block_size, kv_heads, D, generator=g).to(dtype)
    return q, k, v, cache, meta, LayerSpec(heads, kv_heads, D, D ** -0.5, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reference_bounds_float32_math_and_catches_a_missing_key(dtype):
    from polyrunner.attention.reference import reference_paged_attention
    q, k, v, cache, meta, spec = _one_request(200, 5, 4, 2, 64, 16, 0, dtype)
    before = cache.clone()
    expected, bound = attention_reference(q, k, v, cache, meta, spec)
    assert torch.equal(cache, before)   # not modified: the reference writes into a copy
    got = reference_paged_attention(q.float(), k.float(), v.float(), cache.float(), meta, spec).to(dtype)
    assert_detects_errors(lambda o: assert_close_ulp(o, expected, dtype, ulps=1, abs_err=bound), got)
    # the same attention with the oldest key of the context dropped (a mask off by one)
    short = LayerSpec(4, 2, 64, spec.scale, 199)
    wrong = reference_paged_attention(q.float(), k.float(), v.float(), cache.float(), meta, short).to(dtype)
    with pytest.raises(AssertionError):
        assert_close_ulp(wrong, expected, dtype, ulps=1, abs_err=bound)


def test_log_softmax_reference_bounds_float32():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 5000, generator=g) * 6
    logits[0, :10] = float("-inf")
    want, bound = log_softmax_reference(logits)
    for got in (torch.log_softmax(logits, -1), torch.log(torch.softmax(logits, -1)),
                logits - torch.logsumexp(logits, -1, keepdim=True)):
        assert_close_ulp(got, want, ulps=0, abs_err=bound)
    with pytest.raises(AssertionError):
        assert_close_ulp(torch.log_softmax(logits * 1.0001, -1), want, ulps=0, abs_err=bound)
