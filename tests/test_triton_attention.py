"""The Triton paged-attention and KV-write kernels against the reference op.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1,
set here before the kernels are defined) on CPU tensors; with one they run
compiled on it. Tiny shapes: the interpreter runs every program in numpy.
Skipped, with the reason, where triton is not installed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from triton_setup import use_triton  # first: before any kernel module

HAS_CUDA = use_triton()

from polyrunner.attention.metadata import LayerSpec  # noqa: E402
from polyrunner.attention.reference import write_kv  # noqa: E402
from polyrunner.backends.cuda import triton_attention as ta  # noqa: E402
from polyrunner.backends.cuda.attention_launch import TABLE, LaunchParams, launch_params, params_for  # noqa: E402
from polyrunner.backends.cuda.triton_attention import triton_paged_attention, unified_attention  # noqa: E402
from polyrunner.backends.cuda.triton_kv_write import triton_write_kv  # noqa: E402
from test_cuda_backend import make_batch, poison_unused_slots  # noqa: E402
from tolerances import assert_close_ulp, assert_detects_errors, attention_reference, ulp  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and the kernels were defined before TRITON_INTERPRET=1", allow_module_level=True)


def random_mixed_batch(rng, block_size, pad=(3, 2)):
    """Decodes first, then fresh and cached-context prefills, lengths across block edges."""
    edge = [block_size - 1, block_size, block_size + 1, 2 * block_size + 3]
    decodes = [(int(c), 1) for c in rng.choice(edge + [0, 5], size=3)]
    prefills = [(0, int(rng.integers(2, 20))), (int(rng.choice(edge)), int(rng.integers(2, 12))),
                (int(rng.integers(1, 40)), block_size + 1)]
    return decodes + prefills, pad


def run_case(reqs, *, heads, kv_heads, window, block_size, dtype, seed, pad=(3, 2), head=16,
             segments=None, launch=None, decode_only=False):
    spec = LayerSpec(heads, kv_heads, head, head ** -0.5, window)
    T = sum(n for _, n in reqs)
    nb = 2 + sum(-(-(c + n) // block_size) for c, n in reqs)
    meta = make_batch(reqs, block_size=block_size, num_blocks=nb, max_blocks=12, T_pad=T + pad[0],
                      R_pad=len(reqs) + pad[1], seed=seed, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T + pad[0], heads, head, generator=g).to(DEVICE, dtype)
    k = torch.randn(T + pad[0], kv_heads, head, generator=g).to(DEVICE, dtype)
    v = torch.randn(T + pad[0], kv_heads, head, generator=g).to(DEVICE, dtype)
    cache = torch.randn(2, nb, block_size, kv_heads, head, generator=g)
    poison_unused_slots(cache, meta, block_size)
    cache = cache.to(DEVICE, dtype)
    tri_cache = cache.clone()
    # float64 from the same (rounded) inputs; the bound of fp32 math with P in the inputs' dtype for P.V
    ref = attention_reference(q, k, v, cache, meta, spec, p_dtype=None if dtype == torch.float32 else dtype)
    if segments is None and launch is None:
        out = triton_paged_attention(q, k, v, tri_cache, meta, spec)
    else:
        triton_write_kv(tri_cache, k, v, meta.slot_mapping)
        out = unified_attention(q, tri_cache[0], tri_cache[1], meta.query_start_loc, meta.seq_lens,
                                meta.block_tables, spec, segments=segments, launch=launch,
                                decode_only=decode_only)
    return out, ref, tri_cache, T


def check_attention(out, ref, T, rel=0.01, msg=""):
    """out[:T] within one rounding to its dtype plus `attention_reference`'s bound of the float64
    reference; an output `rel` off, or negated, fails."""
    expected, bound = ref
    assert_detects_errors(lambda o: assert_close_ulp(o, expected[:T], out.dtype, ulps=1, abs_err=bound[:T], msg=msg),
                          out[:T], rel=rel)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (6, 2, None), (4, 4, 7), (8, 1, 20)])
def test_mixed_batches_match_reference_fp32(block_size, heads, kv_heads, window):
    rng = np.random.default_rng(block_size * 100 + heads * 10 + kv_heads)
    reqs, pad = random_mixed_batch(rng, block_size)
    out, ref, cache, T = run_case(reqs, heads=heads, kv_heads=kv_heads, window=window,
                                  block_size=block_size, dtype=torch.float32, seed=int(rng.integers(1 << 30)))
    check_attention(out, ref, T)
    assert torch.all(out[T:] == 0), "padded token rows must be zero"


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_fp32(seed):
    """Random shapes: GQA groups 1-8 (some not powers of two), head sizes 16 and 24 (padded to 32),
    windows, block sizes 16 and 32, 1-6 requests decode-first, padded tails; decode-only
    batches also through the split-decode path."""
    rng = np.random.default_rng(1000 + seed)
    block_size = int(rng.choice([16, 32]))
    heads, kv_heads = [(4, 2), (6, 2), (8, 1), (2, 2), (9, 3)][seed % 5]
    window = None if rng.random() < 0.5 else int(rng.integers(1, 40))
    n_dec, n_pre = int(rng.integers(0, 4)), int(rng.integers(0, 3))
    reqs = [(int(rng.integers(0, 3 * block_size)), 1) for _ in range(max(1, n_dec))]
    reqs += [(int(rng.integers(0, 2 * block_size)), int(rng.integers(2, 2 * block_size))) for _ in range(n_pre)]
    pad = (int(rng.integers(0, 4)), int(rng.integers(0, 3)))
    head = int(rng.choice([16, 24]))
    for segments in ([None, 4] if n_pre == 0 else [None]):
        out, ref, _, T = run_case(reqs, heads=heads, kv_heads=kv_heads, window=window, block_size=block_size,
                                  dtype=torch.float32, seed=seed, pad=pad, head=head, segments=segments)
        check_attention(out, ref, T, msg=f"{reqs} window={window} segments={segments}: ")
        assert torch.all(out[T:] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_fp32(dtype):
    if dtype == torch.bfloat16 and not HAS_CUDA:
        pytest.skip("Triton's interpreter multiplies bfloat16 tl.dot operands wrongly (numpy has no bfloat16); "
                    "bfloat16 runs on a GPU (benchmarks/cuda_check.py)")
    reqs = [(40, 1), (17, 1), (0, 9), (15, 18)]
    out, ref, _, T = run_case(reqs, heads=4, kv_heads=2, window=None, block_size=16, dtype=dtype, seed=3)
    assert out.dtype == dtype
    check_attention(out, ref, T, rel=0.02)   # P rounded to dtype: up to u * sum P|v| per output


@pytest.mark.parametrize("window", [None, 9])
def test_split_decode_equals_single_pass(window):
    reqs = [(70, 1), (3, 1), (0, 1), (33, 1)]  # decode only; 70 keys over 3 tiles: some segments empty
    ref_out = None
    for segments in (1, 4):
        out, ref, _, T = run_case(reqs, heads=4, kv_heads=2, window=window, block_size=16,
                                  dtype=torch.float32, seed=5, segments=segments)
        check_attention(out, ref, T)
        assert torch.all(out[T:] == 0)
        ref_out = out if ref_out is None else ref_out
    # split and single pass: each within the bound of the same float64 result, so within twice it of each other
    expected, bound = ref
    assert_close_ulp(out[:T], ref_out[:T], torch.float32, ulps=0,
                     abs_err=2 * (bound[:T] + ulp(expected[:T], torch.float32)))


# the dtypes each dtype class of the launch table runs in here (the interpreter has no bfloat16 dots)
CLASS_DTYPES = {"half": [torch.float16] + ([torch.bfloat16] if HAS_CUDA else []), "float32": [torch.float32]}
GROUPS = {1: (1, 1), 3: (3, 1), 8: (8, 1)}   # GQA group -> (query heads, KV heads)


def table_cases():
    return [pytest.param(key, dtype, id=f"{key[0]}-{key[1]}-{key[2]}-{str(dtype)[6:]}")
            for key in sorted(TABLE) for dtype in CLASS_DTYPES[key[1]]]


@pytest.mark.parametrize("key,dtype", table_cases())
def test_every_launch_entry_matches_reference(key, dtype):
    """Each TABLE entry, forced on mixed batches at its head size for groups 1/3/8: decodes, a fresh
    prefill shorter than BLOCK_Q, a chunked prefill with context spanning two q blocks where BLOCK_Q
    is small (q blocks start off request boundaries: the requests before it do not fill them),
    padded tokens and requests, a sliding window at G=3; decode entries also on their own path
    (decode-only batch, split decode) as `launch_params` picks them."""
    head, _, kind = key
    rel = 0.01 if dtype == torch.float32 else 0.02
    for group, (heads, kv_heads) in GROUPS.items():
        launch = params_for(TABLE[key], group)
        assert launch.fits(group)
        long = launch.block_q + 3 if launch.block_q <= 40 else 20
        reqs = [(33, 1), (0, 1), (0, max(2, min(launch.block_q - 1, 9))), (21, long)]
        window = 7 if group == 3 else None
        out, ref, _, T = run_case(reqs, heads=heads, kv_heads=kv_heads, window=window, block_size=16,
                                  dtype=dtype, seed=group + head, head=head, launch=launch)
        check_attention(out, ref, T, rel=rel, msg=f"{key} G={group} {launch}: ")
        assert torch.all(out[T:] == 0), "padded token rows must be zero"
    if kind == "decode":
        assert launch_params(head, dtype, 8, True) == params_for(TABLE[key], 8)
        reqs = [(40, 1), (3, 1), (0, 1), (70, 1)]
        out, ref, _, T = run_case(reqs, heads=8, kv_heads=1, window=None, block_size=16, dtype=dtype,
                                  seed=head, head=head, decode_only=True, segments=4)
        check_attention(out, ref, T, rel=rel, msg=f"{key} split decode: ")


def test_launch_params_follow_the_table():
    """Head sizes round up to a head bucket (past 256: the 256 row); decode rows are G rounded
    up to >= 16; prefill rows are the entry's, or G rounded up when wider."""
    assert launch_params(128, torch.bfloat16, 8, True) == params_for(TABLE[128, "half", "decode"], 8)
    assert launch_params(80, torch.float16, 4, False) == params_for(TABLE[128, "half", "prefill"], 4)
    assert launch_params(16, torch.float32, 1, False) == params_for(TABLE[64, "float32", "prefill"], 1)
    assert launch_params(512, torch.bfloat16, 2, False) == params_for(TABLE[256, "half", "prefill"], 2)
    for (head, dclass, kind), entry in TABLE.items():
        dtype = CLASS_DTYPES[dclass][0]
        for group in (1, 3, 5, 8, 16, 24):
            p = launch_params(head, dtype, group, kind == "decode")
            assert p.fits(group) and p.block_q == p.block_m // group, (head, dclass, kind, group, p)
            assert p.block_m == max(entry.rows, triton_next_pow2(group))
            assert (p.tile, p.num_warps, p.num_stages) == (entry.tile, entry.num_warps, entry.num_stages)
            if kind == "decode":
                assert p.block_m == max(16, triton_next_pow2(group))
            elif group <= 16:
                assert p.block_m >= 32 and p.block_q * group > 16, "prefill programs take more than 16 rows"


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


def test_unified_attention_launches_through_the_table(monkeypatch):
    """unified_attention asks `launch_params` (head size, dtype, G, decode_only), launches with its
    answer, and rejects a launch that does not fit the group."""
    seen = []

    def spy(head, dtype, group, decode_only):
        seen.append((head, dtype, group, decode_only))
        return LaunchParams(tile=16, block_m=16, block_q=2, num_warps=4, num_stages=1)

    monkeypatch.setattr(ta, "launch_params", spy)
    reqs = [(5, 1), (0, 7), (17, 5)]
    out, ref, _, T = run_case(reqs, heads=8, kv_heads=2, window=None, block_size=16, dtype=torch.float32,
                              seed=11, head=24)
    check_attention(out, ref, T)
    assert seen == [(24, torch.float32, 4, False)]
    spec = LayerSpec(8, 2, 16, 0.25)
    cache = torch.zeros(4, 16, 2, 16)
    args = (torch.zeros(2, 8, 16), cache, cache, torch.tensor([0, 2], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32), torch.ones(1, 1, dtype=torch.int32), spec)
    for bad in (LaunchParams(16, 16, 5, 4, 1), LaunchParams(16, 24, 2, 4, 1), LaunchParams(8, 16, 2, 4, 1)):
        with pytest.raises(ValueError, match="does not fit group 4"):
            unified_attention(*args, launch=bad)


def test_kv_write_matches_reference_and_skips_negative_slots():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 16, 2, 16, generator=g).to(DEVICE)
    k = torch.randn(7, 2, 16, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(7, 2, 16, generator=g).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([17, 18, 95, 40, 0, 0, -1], device=DEVICE)
    ref = cache.clone()
    write_kv(ref, k[:6], v[:6], slots[:6])
    triton_write_kv(cache, k, v, slots)
    assert torch.equal(cache.cpu(), ref.cpu())
    strided = torch.randn(2, 6, 2, 16, 16, generator=g).to(DEVICE).permute(0, 1, 3, 2, 4)  # non-contiguous
    ref = strided.clone()
    write_kv(ref, k[:6], v[:6], slots[:6])
    triton_write_kv(strided, k, v, slots)
    assert torch.equal(strided.cpu(), ref.cpu())


def test_bad_shapes_name_the_field():
    spec = LayerSpec(4, 2, 16, 0.25)
    cache = torch.zeros(6, 16, 3, 16)
    with pytest.raises(ValueError, match="do not match"):
        unified_attention(torch.zeros(2, 4, 16), cache, cache, torch.zeros(2, dtype=torch.int32),
                          torch.zeros(1, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), spec)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_write_kv(torch.zeros(2, 6, 16, 2, 16), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16),
                        torch.zeros(2, dtype=torch.int64))
