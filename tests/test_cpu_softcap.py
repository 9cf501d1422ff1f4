"""Attention logit soft-capping (`LayerSpec.logits_soft_cap`, Gemma 2) in the CPU backend's C++
kernels, against the float64 direct formula (`softcap_reference.softcap_attention`), on each
kernel build (`cpu_kernels`, the decodes `decode_build`: the SIMD paths where built, the portable loops):
decodes (whole and split contexts), prefills (fresh and after a cached prefix; the bfloat16 prefill
kernel's two variants where built, else the general loops, never SDPA, which cannot cap), the
`torch.compile` custom op; soft cap on and off, sliding window on and off, float32 and bfloat16."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from block_tables import random_block_tables
from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.attention import cpu_paged_attention
from softcap_reference import softcap_attention
from tolerances import assert_close_ulp, assert_detects_errors

CAP = 3.0   # scores below are ~N(0, 9): the cap bends most of them (tanh's both regimes)


def _batch(rng, decodes: list[int], prefills: list[tuple[int, int]], block_size: int) -> AttentionMetadata:
    """Decode requests (one query, contexts `decodes`) then prefills ((new tokens, cached prefix) each)."""
    lengths = [1] * len(decodes) + [n for n, _ in prefills]
    ctx = list(decodes) + [n + p for n, p in prefills]
    R, T = len(lengths), sum(lengths)
    num_blocks = sum(-(-L // block_size) for L in ctx) + 4
    tables = random_block_tables(rng, ctx, block_size, num_blocks, R, -(-max(ctx) // block_size))
    qsl = np.zeros(R + 1, np.int32)
    qsl[1:] = np.cumsum(lengths)
    seq_lens = np.array(ctx, np.int32)
    positions = np.concatenate([np.arange(L - n, L) for L, n in zip(ctx, lengths)]).astype(np.int64)
    req = np.repeat(np.arange(R), lengths).astype(np.int32)
    slots = tables[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    t = torch.from_numpy
    return AttentionMetadata(
        num_actual_tokens=T, num_reqs=R, num_decodes=len(decodes), max_query_len=max(lengths),
        max_seq_len=max(ctx), query_start_loc=t(qsl), seq_lens=t(seq_lens), block_tables=t(tables),
        slot_mapping=t(slots), positions=t(positions), token_to_req=t(req), query_start_loc_np=qsl,
        seq_lens_np=seq_lens)


def _inputs(meta: AttentionMetadata, spec: LayerSpec, block_size: int, dtype: torch.dtype, seed: int):
    """q (scaled up so that scores reach the cap), k, v and a random cache, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    T, H, Hkv, D = meta.num_actual_tokens, spec.num_heads, spec.num_kv_heads, spec.head_size
    num_blocks = int(meta.block_tables.max()) + 1
    q = (3 * torch.randn(T, H, D, generator=g)).to(dtype)
    k, v = (torch.randn(T, Hkv, D, generator=g).to(dtype) for _ in range(2))
    cache = torch.randn(2, num_blocks, block_size, Hkv, D, generator=g).to(dtype)
    return q, k, v, cache


def _check_against_reference(got, q, k, v, cache, meta, spec, dtype) -> None:
    """`got` within the bound of the float64 formula (tolerance not vacuous); with a cap, the
    uncapped attention is rejected (the cap is applied, not ignored)."""
    p_dtype = torch.bfloat16 if dtype == torch.bfloat16 else None   # the bfloat16 prefill kernel rounds P
    expected, bound = softcap_attention(q, k, v, cache, meta, spec, p_dtype=p_dtype)

    def check(out):
        assert_close_ulp(out, expected, dtype, ulps=1, abs_err=bound)

    assert_detects_errors(check, got, rel=0.02)
    if spec.logits_soft_cap is not None:
        uncapped, _ = softcap_attention(q, k, v, cache, meta, dataclasses.replace(spec, logits_soft_cap=None))
        with pytest.raises(AssertionError):
            check(uncapped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cap", [None, CAP], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", [None, 24], ids=["full", "window"])
@pytest.mark.parametrize("heads,kv_heads,head,block_size",
                         [(8, 2, 64, 16), (4, 4, 128, 32), (6, 3, 80, 16)], ids=["d64", "d128bs32", "d80"])
def test_softcap_mixed_batch_matches_formula(decode_build, decode_threads, dtype, cap, window, heads, kv_heads,
                                             head, block_size):
    """Decodes (one long enough to split) then prefills (fresh and chunked) in one step."""
    rng = np.random.default_rng(head + block_size)
    meta = _batch(rng, [300, 17, 70], [(40, 0), (23, 50)], block_size)
    spec = LayerSpec(heads, kv_heads, head, head ** -0.5, window, logits_soft_cap=cap)
    q, k, v, cache = _inputs(meta, spec, block_size, dtype, seed=head)
    got = cpu_paged_attention(q, k, v, cache.clone(), meta, spec)
    _check_against_reference(got, q, k, v, cache, meta, spec, dtype)


@pytest.mark.parametrize("variant", ["dpbf16", "amx"])
@pytest.mark.parametrize("window", [None, 37], ids=["full", "window"])
@pytest.mark.parametrize("head", [64, 128])
def test_softcap_bf16_prefill_kernel(cpu_kernels, monkeypatch, variant, window, head):
    """The bfloat16 prefill kernel's variants (forced) cap the scores; where the build has no such
    kernel it declines and the general loops cap them (SDPA, which cannot, never runs)."""
    monkeypatch.setenv("POLYRUNNER_CPU_PREFILL_ATTENTION", variant)
    portable = cpu_kernels is kernels.load_library("portable")
    if variant == "amx" and not portable and kernels.prefill_attention_amx_reason() is not None:
        pytest.skip(f"no AMX prefill attention: {kernels.prefill_attention_amx_reason()}")
    rng = np.random.default_rng(head)
    meta = _batch(rng, [], [(70, 0), (33, 40)], 16)
    spec = LayerSpec(8, 2, head, head ** -0.5, window, logits_soft_cap=CAP)
    q, k, v, cache = _inputs(meta, spec, 16, torch.bfloat16, seed=head + 1)
    ran = []
    real = kernels.prefill_attention_bf16
    monkeypatch.setattr(kernels, "prefill_attention_bf16", lambda *a: ran.append(real(*a)) or ran[-1])
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: pytest.fail("SDPA ran for a soft-capped layer"))
    got = cpu_paged_attention(q, k, v, cache.clone(), meta, spec)
    assert ran == [not portable]
    _check_against_reference(got, q, k, v, cache, meta, spec, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_softcap_compiled_model_op(cpu_kernels, dtype):
    """`polyrunner_cpu::paged_attention` (what a compiled model calls) takes the cap."""
    rng = np.random.default_rng(3)
    meta = _batch(rng, [90, 5], [(20, 0), (9, 30)], 16)
    spec = LayerSpec(8, 2, 64, 0.125, 16, logits_soft_cap=CAP)
    q, k, v, cache = _inputs(meta, spec, 16, dtype, seed=3)
    out = torch.zeros_like(q)
    kernels.paged_attention_op(q, k, v, cache.clone(), meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                               meta.block_tables, out, spec.scale, 16, CAP)
    _check_against_reference(out, q, k, v, cache, meta, spec, dtype)


def test_softcap_rejects_a_negative_cap(cpu_kernels):
    meta = _batch(np.random.default_rng(0), [10], [], 16)
    spec = LayerSpec(2, 2, 64, 0.125, None, logits_soft_cap=-1.0)
    q, k, v, cache = _inputs(meta, spec, 16, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="code 3"):
        cpu_paged_attention(q, k, v, cache, meta, spec)


@pytest.mark.parametrize("simd", [1, 0], ids=["avx512", "loop"])
@pytest.mark.parametrize("cap", [0.5, CAP, 50.0])
def test_softcap_tanh_accuracy(simd, cap):
    """The kernels' cap * tanh(s / cap) (AVX-512 `softcap16` of simd_exp.h, the portable loop) within
    ~1e-7 * cap of float64 tanh for scores across both of its regimes (|s / cap| below and above
    0.3), huge ones included; -inf (a masked score) stays -inf. The AVX-512F one needs only AVX-512F."""
    lib = kernels.load_library("native")
    if lib is None:
        pytest.skip("no C++ compiler: the CPU kernel library is not built")
    s = torch.cat([torch.linspace(-40, 40, 20001) * cap / 10, torch.tensor([1e-30, -1e-7, 1e30, -3e38, 0.0]),
                   torch.tensor([float("-inf")] * 3)])
    out = torch.empty_like(s)
    if lib.pr_softcap_scores(s.data_ptr(), out.data_ptr(), s.numel(), cap, simd) == 1:
        pytest.skip("this CPU lacks AVX-512F: the native build has no softcap16 (the loop case covers it)")
    expected = cap * torch.tanh(s.double() / cap)
    finite = torch.isfinite(s)
    assert torch.all(out[~finite] == float("-inf"))
    err = (out[finite].double() - expected[finite]).abs()
    assert float(err.max()) <= 2e-7 * cap + 2 * float(expected[finite].abs().max()) * 2 ** -24, float(err.max())
    small = finite & (s.abs() < 0.3 * cap) & (s != 0)   # relative accuracy where tanh is nearly linear
    rel = ((out[small].double() - expected[small]) / expected[small]).abs()
    assert float(rel.max()) <= 1e-6, float(rel.max())
