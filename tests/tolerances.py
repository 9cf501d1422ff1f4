"""Tolerances derived from floating-point rounding, for tests that compare a
computation against a float64 reference.

A hand-picked `rtol` that sits near a dtype's rounding step passes on one
machine and fails on another: a different summation order (AMX vs AVX-512 vs
AVX2 vs a GPU) moves a result across a rounding boundary. The rule here:

- compute the reference in float64 from the very inputs the code under test
  saw (bfloat16 inputs rounded first, then widened), so the reference is exact
  to ~1e-16 and the only error left is the implementation's;
- allow `ulps` units in the last place of the *output* dtype at the reference
  value: one rounding to that dtype costs at most 1 ulp (half an ulp, doubled
  where the computed value and the reference sit on either side of a power of
  two), a chain of k roundings in a product costs at most k;
- plus an absolute term for the error made *before* that rounding, in the
  accumulation dtype (float32, usually), derived from the magnitudes of the
  inputs (`dot_error_bound`, `attention_reference`): a sum or dot product of n
  terms computed in any order, blocked, pairwise or with FMA, is within
  gamma(n) * sum |a_i b_i| of the exact value (Higham, "Accuracy and
  Stability of Numerical Algorithms", 2nd ed., section 3.1), so the bound holds
  on every machine and for every correct kernel, not just the one measured.

The bounds are worst cases, not estimates: a correct implementation cannot
fail them, whatever its order of operations (the probabilistic sqrt(n) u
bound is tighter, but a statistical statement; for the sizes tested the
worst case is already below a bfloat16 ulp). They are still tight enough to
catch a real bug: a result off by 1%, of the wrong sign, accumulated in
bfloat16, or missing a term fails (`tests/test_tolerances.py`, and
`assert_detects_errors` in the kernel tests). Measured on a Xeon with AMX:
the kernels' largest error is 0.5x the bound for the linears and attention
(correctly rounded results), 0.73x for RMSNorm (two roundings).
"""

from __future__ import annotations

import math

import torch

__all__ = ["unit_roundoff", "ulp", "gamma", "dot_error_bound", "assert_close_ulp", "assert_detects_errors",
           "assert_linear_close", "attention_reference", "rms_norm_reference", "log_softmax_reference"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: the largest relative error of one round-to-nearest to `dtype` (half its epsilon):
    bfloat16 2^-8, float16 2^-11, float32 2^-24, float64 2^-53."""
    return torch.finfo(dtype).eps / 2


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 tensor: the spacing of `dtype` numbers at |x| (2^(e - p + 1) for |x| in
    [2^e, 2^(e+1)), p the precision in bits), the subnormal spacing below the normal range;
    0 where x is not finite."""
    fi = torch.finfo(dtype)
    a = x.detach().to("cpu", torch.float64).abs()
    finite = torch.isfinite(a)
    _, e = torch.frexp(torch.where(finite, a, 0).clamp(min=fi.smallest_normal))  # a = m * 2^e, m in [0.5, 1)
    spacing = torch.ldexp(torch.full_like(a, fi.eps), e - 1)
    return torch.where(finite, spacing, 0)


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n roundings in `dtype`,
    e.g. of a sum or dot product of n terms (relative to the sum of the terms' magnitudes)."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) is unbounded in {dtype}")
    return nu / (1 - nu)


def dot_error_bound(a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype = torch.float32,
                    extra_roundings: int = 0) -> torch.Tensor:
    """float64 bound of |fl(a @ b.T) - a @ b.T| for a `[..., K]`, b `[N, K]` with products and sums
    in `acc_dtype`, any order: gamma(K + extra_roundings) * (|a| @ |b|.T). `extra_roundings`
    counts further roundings of each term or of the sum (a scale, a bias add, a split-K merge).
    bfloat16 products are exact in float32; the bound covers inexact ones too."""
    K = a.shape[-1]
    mag = a.detach().to("cpu", torch.float64).abs() @ b.detach().to("cpu", torch.float64).abs().T
    return gamma(K + extra_roundings, acc_dtype) * mag


def _report(actual, expected, allowed, err, bad, what: str) -> str:
    ratio = torch.where(bad, err / allowed.clamp(min=1e-300), 0).flatten()
    worst = int(ratio.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), bad.shape))
    return (f"{int(bad.sum())} of {bad.numel()} elements beyond {what}; worst at {idx}: "
            f"actual {float(actual.flatten()[worst])!r}, expected {float(expected.flatten()[worst])!r}, "
            f"|error| {float(err.flatten()[worst]):.3g} > allowed {float(allowed.flatten()[worst]):.3g}")


def assert_close_ulp(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *,
                     ulps: float = 1.0, abs_err: torch.Tensor | float = 0.0, msg: str = "") -> None:
    """Elementwise |actual - expected| <= ulps * ulp(expected, dtype) + abs_err, in float64.

    expected: the float64 (exact) reference; dtype: the precision `actual` was rounded to
    (default: actual's dtype); ulps: how many roundings to `dtype` the result went through
    (1: computed in float32, rounded once); abs_err: the error made before that rounding
    (`dot_error_bound`, `attention_reference`), broadcast against the values. Non-finite
    values must match exactly (NaN where NaN, the same infinity)."""
    dtype = dtype or actual.dtype
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    assert a.shape == e.shape, f"{msg}shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{msg}NaN at {int((nan_a ^ nan_e).sum())} positions where the other has none"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), f"{msg}infinities differ"
    finite = ~(nan_a | inf_a)
    a, e = torch.where(finite, a, 0), torch.where(finite, e, 0)
    abs_err = abs_err.detach().to("cpu", torch.float64) if isinstance(abs_err, torch.Tensor) else abs_err
    allowed = (ulps * ulp(e, dtype) + abs_err).expand(e.shape)
    err = (a - e).abs()
    bad = err > allowed
    if bool(bad.any()):
        raise AssertionError(msg + _report(a, e, allowed, err, bad, f"{ulps} ulp(s) of {dtype} + abs_err"))


def assert_detects_errors(check, actual: torch.Tensor, rel: float = 0.01) -> None:
    """The tolerance is not vacuous: `check(x)` (an assertion on a candidate output, e.g. a
    lambda around `assert_close_ulp`) accepts `actual` but rejects it scaled by 1 + rel
    (default: 1% off) and with its sign flipped. Perturbed in float64 (no re-rounding)."""
    check(actual)
    x = actual.detach().to("cpu", torch.float64)
    for name, wrong in ((f"{rel:.0%} too large", x * (1 + rel)), ("negated", -x)):
        try:
            check(wrong)
        except AssertionError:
            continue
        raise AssertionError(f"the tolerance accepts an output {name}: it would not catch that bug")


def assert_linear_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                        acc_dtype: torch.dtype = torch.float32, msg: str = "") -> None:
    """A linear layer's output `y` = x @ w.T (+ bias), rounded once to y's dtype, against the float64
    product of the same (already rounded) x, w and bias: within `dot_error_bound` (float32
    accumulation in any order, the bias add one more rounding) plus 1 ulp; and 1% off or negated
    fails (`assert_detects_errors`)."""
    ref = x.detach().double() @ w.detach().double().T
    if bias is not None:
        ref = ref + bias.detach().double()
    bound = dot_error_bound(x.reshape(-1, x.shape[-1]), w, acc_dtype,
                            extra_roundings=int(bias is not None)).reshape(ref.shape)
    if bias is not None:
        bound = bound + gamma(x.shape[-1] + 1, acc_dtype) * bias.detach().double().abs()

    def check(out):
        assert_close_ulp(out, ref, y.dtype, ulps=1, abs_err=bound, msg=msg)

    assert_detects_errors(check, y)


def rms_norm_reference(s: torch.Tensor, weight: torch.Tensor, eps: float,
                       dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 w * s / rms(s), the error an RMSNorm in `dtype` may make before its last rounding):
    Hugging Face's RMSNorm normalises in float32 (a sum of H squares, mean, + eps, sqrt,
    reciprocal, product: within gamma(H + 6) relative), rounds the normalised value to `dtype`
    (bfloat16: u = 2^-8 relative) and multiplies by the weight (bfloat16: exactly, the product fits
    float32) before rounding once more (check with `ulps=1`)."""
    s = s.detach().double()
    ref = weight.detach().double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return ref, ref.abs() * (unit_roundoff(dtype) + gamma(s.shape[-1] + 6))


def log_softmax_reference(logits, acc_dtype: torch.dtype = torch.float32,
                          exp_rel: float = 2.0 ** -20) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 log_softmax over the last dim of the same logits, the error bound of computing it in
    `acc_dtype`: x_i - m - log(sum_j exp(x_j - m)) with m the row maximum). With u = unit_roundoff:
        u |x_i - m|                     the subtraction
        + sum_j p_j (u |x_j - m|) + exp_rel + gamma(V)   each exp's argument and approximation, the sum
        + u |lse| + u |result|          the log and the final subtraction (lse = log sum_j exp(x_j - m))
    also covers log(softmax(x)) and x - logsumexp(x). Accepts numpy arrays or tensors."""
    x = torch.as_tensor(logits).detach().to("cpu", torch.float64)
    u = unit_roundoff(acc_dtype)
    d = x - x.amax(-1, keepdim=True)
    lse = torch.logsumexp(d, dim=-1, keepdim=True)
    ref = d - lse
    p = ref.exp()
    ad, ar = (torch.where(torch.isfinite(t), t.abs(), 0) for t in (d, ref))   # -inf logits: exact -inf
    bound = (u * ad + (p * u * ad).sum(-1, keepdim=True) + exp_rel + gamma(x.shape[-1], acc_dtype)
             + u * lse.abs() + u * ar)
    return ref, bound


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta,
                        spec, *, acc_dtype: torch.dtype = torch.float32, p_dtype: torch.dtype | None = None,
                        exp_rel: float = 2.0 ** -20) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, abs_err): paged attention (write k/v, then attend, as
    `reference_paged_attention`) in float64 from the same inputs, and a float64 bound of the
    error of a kernel that computes it in `acc_dtype` before rounding the output (the
    output's own rounding is `assert_close_ulp`'s `ulps`). `kv_cache` is not modified.

    With s_j = scale q.k_j, P_j = softmax(s)_j, o = sum_j P_j v_j, a kernel's probabilities
    are P_j (1 + d_j) up to a factor common to all j (the running maximum and its
    corrections cancel in the normalisation), where
        d_j <= gamma(D + 2) * scale * sum_d |q_d k_jd|   the score's dot product (+ scaling)
             + 2 u |s_j - max s|                          rounding of s_j - m and its log2(e) multiple
             + exp_rel                                    the exp approximation (2^-20: torch's exp_u20,
                                                          the C++ kernels' polynomial, a GPU's ex2.approx)
             + u(p_dtype)                                 P rounded to p_dtype for the P.V product, if so
    so |o' - o| <= sum_j P_j d_j (|v_j| + |o|) + gamma(2L + 8) (sum_j P_j |v_j| + |o|), the last
    term the float32 sums over L keys, the rescaling after each key block, the final division
    and a split-context merge."""
    from polyrunner.attention.reference import causal_mask, gather_context, write_kv

    f64 = torch.float64
    u = unit_roundoff(acc_dtype)
    u_p = unit_roundoff(p_dtype) if p_dtype is not None else 0.0
    cache = kv_cache.detach().to("cpu", f64).clone()
    write_kv(cache, k.detach().to("cpu", f64), v.detach().to("cpu", f64), meta.slot_mapping.cpu())
    qd = q.detach().to("cpu", f64)
    out, bound = torch.zeros_like(qd), torch.zeros_like(qd)
    G = spec.num_heads // spec.num_kv_heads
    D = qd.shape[-1]
    block_size = cache.shape[2]
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    tables = meta.block_tables.cpu()
    for r in range(meta.num_reqs):
        start, end, L = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        if end <= start or L <= 0:
            continue
        ck, cv = gather_context(cache, tables[r, :-(-L // block_size)].long(), L)   # [L, Hkv, D]
        ck, cv = ck.repeat_interleave(G, dim=1).transpose(0, 1), cv.repeat_interleave(G, dim=1).transpose(0, 1)
        qr = qd[start:end].transpose(0, 1)                                          # [H, n, D]
        mask = causal_mask(end - start, L, spec.sliding_window, torch.device("cpu"))
        s = (qr @ ck.transpose(1, 2)) * spec.scale
        s_mag = (qr.abs() @ ck.abs().transpose(1, 2)) * abs(spec.scale)
        s = s.masked_fill(~mask, -math.inf)
        p = torch.softmax(s, dim=-1)
        o = p @ cv
        d = (gamma(D + 2, acc_dtype) * s_mag + 2 * u * (s.amax(-1, keepdim=True) - s).nan_to_num(0, 0, 0)
             + exp_rel + u_p)
        pd = torch.where(mask, p * d, 0)
        pv = p @ cv.abs()
        err = pd @ cv.abs() + pd.sum(-1, keepdim=True) * o.abs() + gamma(2 * L + 8, acc_dtype) * (pv + o.abs())
        err = err * (1 + 2 * float(torch.where(mask, d, 0).max()))   # e^d - 1 <= d e^d
        out[start:end] = o.transpose(0, 1)
        bound[start:end] = err.transpose(0, 1)
    return out, bound
