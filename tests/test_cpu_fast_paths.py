"""CPU fast paths: the C++ paged attention kernel and the SDPA prefill path
against the reference attention, and compiled against eager execution."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import reference_paged_attention
from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.attention import cpu_paged_attention

needs_kernel = pytest.mark.skipif(kernels.paged_attention_kernel() is None,
                                  reason="no C++ compiler: the CPU kernel is not built")


def _batch(rng, *, num_decodes, num_prefills, block_size, num_blocks, max_blocks, pad_tokens=0,
           pad_reqs=0):
    """A random decode-first batch over random, non-overlapping block tables."""
    qlens, ctx = [], []
    for _ in range(num_decodes):
        qlens.append(1)
        ctx.append(int(rng.integers(1, max_blocks * block_size)))
    for i in range(num_prefills):
        n = int(rng.integers(2, 40))
        prior = 0 if i % 2 == 0 else int(rng.integers(1, max_blocks * block_size - n))
        qlens.append(n)
        ctx.append(prior + n)
    R, T = len(qlens), sum(qlens)
    free = rng.permutation(np.arange(1, num_blocks))  # block 0 is the null block
    tables = np.zeros((R + pad_reqs, max_blocks), np.int32)
    used = 0
    for r, L in enumerate(ctx):
        nb = -(-L // block_size)
        tables[r, :nb] = free[used:used + nb]
        used += nb
    qsl = np.full(R + pad_reqs + 1, T, np.int32)
    qsl[0] = 0
    qsl[1:R + 1] = np.cumsum(qlens)
    seq_lens = np.zeros(R + pad_reqs, np.int32)
    seq_lens[:R] = ctx
    tok_req = np.zeros(T + pad_tokens, np.int32)
    positions = np.zeros(T + pad_tokens, np.int64)
    slots = np.zeros(T + pad_tokens, np.int64)  # padded tokens write the null slot
    for r in range(R):
        s, e = qsl[r], qsl[r + 1]
        pos = np.arange(ctx[r] - (e - s), ctx[r])
        tok_req[s:e] = r
        positions[s:e] = pos
        slots[s:e] = tables[r, pos // block_size].astype(np.int64) * block_size + pos % block_size
    t = torch.from_numpy
    return AttentionMetadata(
        num_actual_tokens=T, num_reqs=R, num_decodes=num_decodes, max_query_len=max(qlens),
        max_seq_len=max(ctx), query_start_loc=t(qsl), seq_lens=t(seq_lens), block_tables=t(tables),
        slot_mapping=t(slots), positions=t(positions), token_to_req=t(tok_req),
        query_start_loc_np=qsl, seq_lens_np=seq_lens)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (6, 2, None), (8, 2, 7), (9, 3, 40)])
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_reference(dtype, heads, kv_heads, window, seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    block_size, num_blocks, head = 16, 96, 64
    meta = _batch(rng, num_decodes=int(rng.integers(0, 6)), num_prefills=int(rng.integers(1, 4)),
                  block_size=block_size, num_blocks=num_blocks, max_blocks=6, pad_tokens=3)
    T = meta.num_padded_tokens
    q = torch.randn(T, heads, head, dtype=dtype)
    # k and v as strided views of one fused projection, like the model's qkv split
    kv = torch.randn(T, 2 * kv_heads * head + 32, dtype=dtype)
    k = kv[:, : kv_heads * head].view(T, kv_heads, head)
    v = kv[:, kv_heads * head: 2 * kv_heads * head].view(T, kv_heads, head)
    spec = LayerSpec(heads, kv_heads, head, head ** -0.5, window)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head, dtype=dtype)
    cache_ref = cache.clone()
    # the cached context before this step: identical in both caches
    expected = reference_paged_attention(q, k, v, cache_ref, meta, spec)
    got = cpu_paged_attention(q, k, v, cache, meta, spec)
    n = meta.num_actual_tokens
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[:n], expected[:n], **tol)
    assert torch.equal(cache[:, 1:], cache_ref[:, 1:])  # same slots written
    assert torch.all(got[n:] == 0)


@needs_kernel
def test_kernel_decode_all_requests_with_padding():
    """The compiled path: one op call over padded requests (seq_len 0) and tokens."""
    rng = np.random.default_rng(3)
    meta = _batch(rng, num_decodes=5, num_prefills=0, block_size=16, num_blocks=64, max_blocks=4,
                  pad_tokens=3, pad_reqs=3)
    T, (H, Hkv, D) = meta.num_padded_tokens, (9, 3, 64)
    q, k, v = (torch.randn(T, h, D, dtype=torch.bfloat16) for h in (H, Hkv, Hkv))
    spec = LayerSpec(H, Hkv, D, D ** -0.5, None)
    cache = torch.randn(2, 64, 16, Hkv, D, dtype=torch.bfloat16)
    cache_ref = cache.clone()
    expected = reference_paged_attention(q, k, v, cache_ref, meta, spec)
    out = torch.zeros_like(q)
    kernels.paged_attention_op(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                               meta.block_tables, out, spec.scale, 0)
    torch.testing.assert_close(out[:5], expected[:5], atol=2e-2, rtol=2e-2)
    assert torch.all(out[5:] == 0)
