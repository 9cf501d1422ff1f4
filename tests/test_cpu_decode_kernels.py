"""The CPU backend's decode kernels against torch references, on each kernel
build (`cpu_kernels`: AVX-512 BF16 where the CPU has it, and the portable
loops): the AVX512_BF16 small-M linear, the multi-request decode attention
(split contexts merged, the thread pool sharing the work), the greedy argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from block_tables import random_block_tables
from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import reference_paged_attention
from polyrunner.backends.cpu import kernels
from tolerances import assert_close_ulp, assert_detects_errors, assert_linear_close, attention_reference


# ---- AVX512_BF16 small-M linear ---------------------------------------------------
def _dpbf16(lib):
    if lib.pr_dpbf16_available() != 1:
        pytest.skip("no AVX512_BF16 linear in this build: the portable build, or a CPU without "
                    "AVX512F + AVX512_BF16 (oneDNN runs the linears there)")


@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 13, 16, 33, 64, 100])   # 33+: rows split in two where groups are few
@pytest.mark.parametrize("N,K", [(16, 2), (48, 64), (960, 576), (80, 96), (576, 1536), (4096, 576)])
def test_dpbf16_linear_matches_matmul(cpu_kernels, pool_threads, M, N, K):
    _dpbf16(cpu_kernels)
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / 8).to(torch.bfloat16)
    with kernels.use_kernels("native"):
        y = kernels.dpbf16_linear_bf16(x, kernels.dpbf16_pack_bf16(w), N)
    assert_linear_close(y, x, w)  # fp32 accumulation, one rounding


def test_dpbf16_linear_strided_rows_and_declines(cpu_kernels):
    _dpbf16(cpu_kernels)
    g = torch.Generator().manual_seed(1)
    with kernels.use_kernels("native"):
        x = torch.randn(5, 128, generator=g).to(torch.bfloat16)[:, :64]  # row stride 128
        w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
        y = kernels.dpbf16_linear_bf16(x, kernels.dpbf16_pack_bf16(w), 32)
        assert_linear_close(y, x, w)
        assert kernels.dpbf16_pack_bf16(torch.randn(24, 64, generator=g).to(torch.bfloat16)) is None  # N % 16
        assert kernels.dpbf16_pack_bf16(torch.randn(32, 7, generator=g).to(torch.bfloat16)) is None   # K % 2
        assert kernels.dpbf16_linear_bf16(x.float(), kernels.dpbf16_pack_bf16(w), 32) is None


def test_packed_linear_uses_dpbf16_without_amx(monkeypatch, cpu_kernels):
    """Without AMX the measured plan has no AMX, and a PackedLinear running AVX512_BF16 for small
    steps and oneDNN above computes both."""
    from polyrunner.backends.cpu.packed_linear import PackedLinear, packing_supported
    _dpbf16(cpu_kernels)
    if not packing_supported(torch.bfloat16):
        pytest.skip("oneDNN bfloat16 packing unavailable on this CPU")
    monkeypatch.setenv("POLYRUNNER_CPU_AMX", "0")
    monkeypatch.delenv("POLYRUNNER_CPU_DPBF16", raising=False)   # the path under test, whatever the caller's env
    monkeypatch.setenv("POLYRUNNER_CPU_AVX512", "0")   # (the AVX-512F linear: test_cpu_linear_avx512.py)
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(192, 128, generator=g) / 8).to(torch.bfloat16)
    with kernels.use_kernels("native"):
        from polyrunner.backends.cpu import kernel_table
        assert kernel_table.available() == ["dpbf16", "onednn"]
        lin = PackedLinear(w, None, 64, ("dpbf16",) * 65 + ("onednn",))
        assert lin.pool_rows == 64
        x = torch.randn(80, 128, generator=g).to(torch.bfloat16)
        assert_linear_close(lin(x), x, w)            # oneDNN
        assert_linear_close(lin(x[:7]), x[:7], w)    # AVX512_BF16


# ---- decode attention ---------------------------------------------------------------
def _decode_batch(rng, ctx: list[int], block_size: int, num_blocks: int, pad_reqs: int = 0) -> AttentionMetadata:
    """One query per request over random, non-overlapping block tables (then padded requests)."""
    R = len(ctx)
    max_blocks = max(-(-L // block_size) for L in ctx)
    tables = random_block_tables(rng, ctx, block_size, num_blocks, R + pad_reqs, max_blocks)
    qsl = np.concatenate([np.arange(R + 1), np.full(pad_reqs, R)]).astype(np.int32)
    seq_lens = np.concatenate([ctx, np.zeros(pad_reqs)]).astype(np.int32)
    pos = np.asarray(ctx, np.int64) - 1
    slots = tables[np.arange(R), pos // block_size].astype(np.int64) * block_size + pos % block_size
    t = torch.from_numpy
    return AttentionMetadata(
        num_actual_tokens=R, num_reqs=R, num_decodes=R, max_query_len=1, max_seq_len=max(ctx),
        query_start_loc=t(qsl), seq_lens=t(seq_lens), block_tables=t(tables), slot_mapping=t(slots),
        positions=t(pos), token_to_req=t(np.arange(R, dtype=np.int32)), query_start_loc_np=qsl,
        seq_lens_np=seq_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx", [[700], [1, 300], [17, 500, 64], [5, 9, 200, 33, 1000, 2, 128, 77, 64]])
@pytest.mark.parametrize("heads,kv_heads,head,block_size,window",
                         [(9, 3, 64, 16, None), (8, 2, 128, 16, 100), (4, 4, 96, 32, None), (6, 1, 80, 16, 300)])
def test_decode_attention_matches_reference(decode_build, decode_threads, dtype, ctx, heads, kv_heads, head,
                                            block_size, window):
    """Every request one query, contexts long enough to be split across threads
    (fewer (request, KV head) pairs than threads) and merged."""
    from polyrunner.backends.cpu.attention import cpu_paged_attention
    rng = np.random.default_rng(len(ctx) * 7 + head)
    g = torch.Generator().manual_seed(len(ctx) * 7 + head)
    num_blocks = sum(-(-L // block_size) for L in ctx) + 8
    meta = _decode_batch(rng, ctx, block_size, num_blocks)
    R = len(ctx)
    q = torch.randn(R, heads, head, generator=g).to(dtype)
    k, v = torch.randn(R, kv_heads, head, generator=g).to(dtype), torch.randn(R, kv_heads, head, generator=g).to(dtype)
    spec = LayerSpec(heads, kv_heads, head, head ** -0.5, window)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head, generator=g).to(dtype)
    cache_ref = cache.clone()
    reference_paged_attention(q, k, v, cache_ref, meta, spec)   # the cache writes to compare
    expected, bound = attention_reference(q, k, v, cache, meta, spec)   # float64; fp32 math, one rounding
    got = cpu_paged_attention(q, k, v, cache, meta, spec)
    assert_detects_errors(lambda out: assert_close_ulp(out, expected, dtype, ulps=1, abs_err=bound), got)
    assert torch.equal(cache, cache_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.125, 1.0])
def test_decode_attention_follows_growing_scores(decode_build, decode_threads, dtype, scale):
    """Scores that keep growing along the context (keys scaled up with their position) move the
    softmax maximum again and again, by less and by more than the kernel's rescale threshold."""
    from polyrunner.backends.cpu.attention import cpu_paged_attention
    rng = np.random.default_rng(11)
    g = torch.Generator().manual_seed(11)
    ctx, bs = [700, 300, 33], 16
    num_blocks = sum(-(-L // bs) for L in ctx) + 4
    meta = _decode_batch(rng, ctx, bs, num_blocks)
    R = len(ctx)
    q = torch.randn(R, 9, 64, generator=g).to(dtype)
    k, v = torch.randn(R, 3, 64, generator=g).to(dtype), torch.randn(R, 3, 64, generator=g).to(dtype)
    cache = torch.randn(2, num_blocks, bs, 3, 64, generator=g)
    for r, L in enumerate(ctx):
        for pos in range(L):
            cache[0, int(meta.block_tables[r, pos // bs]), pos % bs] *= 0.2 + 3 * pos / L
    cache = cache.to(dtype)
    spec = LayerSpec(9, 3, 64, scale, None)
    expected, bound = attention_reference(q, k, v, cache.clone(), meta, spec)
    got = cpu_paged_attention(q, k, v, cache, meta, spec)
    assert_detects_errors(lambda out: assert_close_ulp(out, expected, dtype, ulps=1, abs_err=bound), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_skips_padded_requests(decode_build, decode_threads, dtype):
    rng = np.random.default_rng(5)
    g = torch.Generator().manual_seed(5)
    meta = _decode_batch(rng, [300, 40], 16, 40, pad_reqs=3)
    q = torch.randn(2, 9, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 3, 64, generator=g).to(dtype) for _ in range(2))
    spec = LayerSpec(9, 3, 64, 0.125, None)
    cache = torch.randn(2, 40, 16, 3, 64, generator=g).to(dtype)
    expected, bound = attention_reference(q, k, v, cache, meta, spec)
    out = torch.zeros(4, 9, 64, dtype=dtype)
    kernels.paged_attention_op(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                               meta.block_tables, out, spec.scale, 0)
    assert_close_ulp(out[:2], expected, ulps=1, abs_err=bound)
    assert torch.all(out[2:] == 0)


# ---- greedy argmax ------------------------------------------------------------------
def test_argmax_matches_torch(cpu_kernels, pool_threads):
    """First maximum, NaN counting as the maximum (torch.argmax), any row length."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 49152, generator=g)
    x[1, 100] = x[1, 40000] = float("nan")   # first NaN wins
    x[2] = float("-inf")                      # all -inf: index 0
    x[3, 7] = x[3, 9] = 100.0                 # ties: the first
    x[4, 49151] = float("nan")                # NaN in the last lane
    x[5, 49150] = 1e30                        # maximum in the scalar tail region
    x[6, 3] = float("inf")
    with kernels.use_kernels("native" if kernels.simd_bf16(cpu_kernels) else "portable"):
        for t in (x, x[:, :17], x[:, :5], x[:, :1], x[:1], x[::2], x[:0]):
            assert torch.equal(kernels.argmax_f32(t), t.argmax(dim=-1))
        y = torch.randn(3, 40, generator=g).to(torch.bfloat16)   # not float32: torch's own
        assert torch.equal(kernels.argmax_f32(y), y.argmax(dim=-1))


def test_sampler_uses_the_backend_argmax_for_greedy_rows():
    """`Sampler(argmax=)` (the core hook the CPU executor fills) replaces argmax for
    greedy rows only, after the logits processors."""
    from polyrunner.sample import Sampler, SamplingMetadata
    calls = []

    def argmax(logits):
        calls.append(logits.clone())
        return logits.argmax(dim=-1)

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    meta = SamplingMetadata(num_reqs=3, all_greedy=True, all_random=False,
                            allowed_token_ids_mask=torch.zeros(3, 50, dtype=torch.bool))
    meta.allowed_token_ids_mask[:, 0] = True   # token 0 masked before the argmax
    logits[:, 0] = 1e9
    out = Sampler(argmax=argmax)(logits, meta)
    assert len(calls) == 1 and torch.all(calls[0][:, 0] == float("-inf"))
    assert torch.equal(out.sampled_token_ids, logits[:, 1:].argmax(dim=-1) + 1)


# ---- thread pool and thread count ------------------------------------------------------
def test_pool_runs_every_chunk_once_whatever_takes_part(cpu_kernels):
    """Every output is written exactly once whether 1, 2 or all 4 threads take part
    (the rest asleep), and after a restart."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g)
    w = torch.randn(1000, 96, generator=g)  # 37 rows x 1000 features: many chunks
    want = x.argmax(dim=-1)
    assert cpu_kernels.pr_pool_start(4, None, 0, 50) == 3
    try:
        for active in (1, 2, 4, 9, 0):
            assert cpu_kernels.pr_pool_set_active(active) == min(max(active, 1), 4)
            with kernels.use_kernels("native" if kernels.simd_bf16(cpu_kernels) else "portable"):
                for _ in range(20):
                    assert torch.equal(kernels.argmax_f32(x), want)
                    got = kernels.argmax_f32(w)
                    assert torch.equal(got, w.argmax(dim=-1))
    finally:
        cpu_kernels.pr_pool_start(1, None, 0, 200)


def test_physical_cpus_takes_one_cpu_per_core(tmp_path):
    from polyrunner.backends.cpu.threads import physical_cpus
    siblings = {0: "0,4", 1: "1,5", 2: "2-3", 3: "2-3", 4: "0,4", 5: "1,5"}  # cpu 6: unreadable
    for cpu, text in siblings.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    assert physical_cpus([0, 1, 2, 3, 4, 5, 6], tmp_path) == [0, 1, 2, 6]
    assert physical_cpus([4, 5, 3], tmp_path) == [3, 4, 5]


def test_thread_settings_are_checked(monkeypatch):
    from polyrunner.backends.cpu import threads
    monkeypatch.setenv("POLYRUNNER_CPU_THREADS", "3")
    with monkeypatch.context() as m:
        m.setattr(threads, "usable_cpus", lambda: [0, 1, 2, 3])
        assert threads.default_threads() == 3
        m.setattr(threads, "usable_cpus", lambda: [1])   # a rank pinned to its share: one CPU
        assert threads.default_threads() == 1
    monkeypatch.setenv("POLYRUNNER_CPU_THREADS", "auto")
    assert threads.default_threads() == len(threads.physical_cpus()) >= 1
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("POLYRUNNER_CPU_THREADS", bad)
        with pytest.raises(ValueError, match="POLYRUNNER_CPU_THREADS must be 'auto' or an integer >= 1"):
            threads.default_threads()
    monkeypatch.setenv("POLYRUNNER_CPU_SPIN_US", "-1")
    with pytest.raises(ValueError, match="POLYRUNNER_CPU_SPIN_US must be an integer >= 0"):
        threads.spin_us()
