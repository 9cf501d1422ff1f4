"""The bfloat16 prefill attention kernel (backends/cpu/prefill_attention.cpp) against the
reference attention (float64, `tolerances.attention_reference`) and against torch's SDPA path, on prompts long enough
for many query tiles (16) and key blocks (32): fresh prompts, chunks after a cached
prefix, GQA, sliding windows, head dims 64 and 128, cache blocks of 16 and 32.
(Short prompts in every path combination: test_cpu_fast_paths.test_kernel_matches_reference.)
The portable build has no such kernel and says so (SDPA runs instead)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from block_tables import random_block_tables
from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.attention import cpu_paged_attention
from tolerances import assert_close_ulp, assert_detects_errors, attention_reference


def _prefills(rng, lengths, priors, block_size, num_blocks):
    """A batch of prefill requests (len lengths[i] new tokens after priors[i] cached ones)."""
    ctx = [p + n for p, n in zip(priors, lengths)]
    R, T = len(lengths), sum(lengths)
    max_blocks = -(-max(ctx) // block_size)
    tables = random_block_tables(rng, ctx, block_size, num_blocks, R, max_blocks)
    qsl = np.zeros(R + 1, np.int32)
    qsl[1:] = np.cumsum(lengths)
    positions = np.concatenate([np.arange(p, p + n) for p, n in zip(priors, lengths)]).astype(np.int64)
    req = np.repeat(np.arange(R), lengths).astype(np.int32)
    slots = tables[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    t = torch.from_numpy
    seq_lens = np.array(ctx, np.int32)
    return AttentionMetadata(
        num_actual_tokens=T, num_reqs=R, num_decodes=0, max_query_len=max(lengths), max_seq_len=max(ctx),
        query_start_loc=t(qsl), seq_lens=t(seq_lens), block_tables=t(tables), slot_mapping=t(slots),
        positions=t(positions), token_to_req=t(req), query_start_loc_np=qsl, seq_lens_np=seq_lens)


CASES = [(9, 3, 64, None, 0), (4, 4, 128, None, 0), (8, 2, 64, 100, 0), (6, 3, 128, 37, 0),
         (9, 3, 64, None, 1), (4, 4, 128, 37, 1)]


@pytest.mark.parametrize("heads,kv_heads,head,window,ramp", CASES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("variant", ["dpbf16", "amx"])
def test_prefill_kernel_matches_reference_and_sdpa(cpu_kernels, monkeypatch, heads, kv_heads, head, window, ramp,
                                                   block_size, variant):
    """Each variant forced (`POLYRUNNER_CPU_PREFILL_ATTENTION`): AVX512_BF16 tiles, AMX tiles. `ramp`: the
    new keys grow with position and the queries are 3x larger, so a row's largest score keeps rising
    block after block (the dpbf16 tiles' softmax reference must move, rescaling sums and outputs)."""
    monkeypatch.setenv("POLYRUNNER_CPU_PREFILL_ATTENTION", variant)
    if variant == "amx":
        if cpu_kernels is kernels.load_library("portable"):
            pytest.skip("the portable build has no prefill kernel (the dpbf16 case checks SDPA runs)")
        with kernels.use_kernels("native"):
            if kernels.prefill_attention_amx_reason() is not None:
                pytest.skip(f"no AMX prefill attention: {kernels.prefill_attention_amx_reason()}")
    rng = np.random.default_rng(heads * 1000 + head + block_size)
    g = torch.Generator().manual_seed(head + block_size)
    lengths, priors = [300, 17, 129, 1 + 64], [0, 0, 211, 40]    # fresh prompts and chunks after a prefix
    num_blocks = 160
    meta = _prefills(rng, lengths, priors, block_size, num_blocks)
    T = meta.num_actual_tokens
    q = torch.randn(T, heads, head, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(T, kv_heads, head, generator=g).to(torch.bfloat16) for _ in range(2))
    if ramp:
        q = (q.float() * 3).to(torch.bfloat16)
        k = (k.float() * (1 + meta.positions.float() / 40)[:, None, None]).to(torch.bfloat16)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head, generator=g).to(torch.bfloat16)
    spec = LayerSpec(heads, kv_heads, head, head ** -0.5, window)
    # float64 of the same bfloat16 inputs; the bound: fp32 sums, P rounded to bfloat16 (both paths)
    expected, bound = attention_reference(q, k, v, cache, meta, spec, p_dtype=torch.bfloat16)

    def check(out):
        assert_close_ulp(out, expected, torch.bfloat16, ulps=1, abs_err=bound)

    ran = []
    real = kernels.prefill_attention_bf16
    monkeypatch.setattr(kernels, "prefill_attention_bf16", lambda *a: ran.append(real(*a)) or ran[-1])
    got = cpu_paged_attention(q, k, v, cache.clone(), meta, spec)
    monkeypatch.setenv("POLYRUNNER_CPU_PREFILL_KERNEL", "0")
    sdpa = cpu_paged_attention(q, k, v, cache.clone(), meta, spec)
    if cpu_kernels is kernels.load_library("portable"):
        assert ran == [False, False]    # no AVX512_BF16 code in the portable build: SDPA ran
        return
    assert ran == [True, False]         # the kernel ran; turned off, SDPA
    # both within the bound (P in bfloat16: a 2% error must fail, 1% may hide where |o| << sum P|v|),
    # and the kernel on average no further from float64 than torch's SDPA on the same inputs
    check(sdpa)
    assert_detects_errors(check, got, rel=0.02)
    err, sdpa_err = (got.double() - expected).abs(), (sdpa.double() - expected).abs()
    assert err.mean() <= 1.5 * sdpa_err.mean(), (err.mean(), sdpa_err.mean())


def test_prefill_kernel_declines_what_it_does_not_run(cpu_kernels):
    meta = _prefills(np.random.default_rng(0), [20], [0], 16, 8)
    out = torch.empty(20, 4, 80, dtype=torch.bfloat16)
    for q, cache in [(torch.zeros(20, 4, 80, dtype=torch.bfloat16), torch.zeros(2, 8, 16, 2, 80, dtype=torch.bfloat16)),
                     (torch.zeros(20, 4, 64), torch.zeros(2, 8, 16, 2, 64))]:
        assert not kernels.prefill_attention_bf16(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                                  out if q.dtype == torch.bfloat16 else torch.empty_like(q), 0, 1,
                                                  0.1, 0)
