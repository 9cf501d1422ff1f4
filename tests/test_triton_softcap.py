"""The Triton paged-attention kernel's logit soft cap (`LayerSpec.logits_soft_cap`, Gemma 2; the
kernel's SOFTCAP constexpr) against the float64 direct formula (`softcap_reference`), with and
without sliding windows: mixed prefill + decode batches (the prefill launch), decode-only batches
(the decode launch, single pass and split into segments). Under Triton's interpreter without a
GPU (TRITON_INTERPRET=1 set before the kernels are defined): tiny shapes, float32 and float16
(the interpreter has no bfloat16 dots; see test_triton_attention.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from triton_setup import use_triton  # first: before any kernel module

HAS_CUDA = use_triton()

from polyrunner.attention.metadata import LayerSpec  # noqa: E402
from polyrunner.backends.cuda.triton_attention import triton_paged_attention, unified_attention  # noqa: E402
from polyrunner.backends.cuda.triton_kv_write import triton_write_kv  # noqa: E402
from softcap_reference import softcap_attention  # noqa: E402
from test_cuda_backend import make_batch, poison_unused_slots  # noqa: E402
from tolerances import assert_close_ulp, assert_detects_errors  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and the kernels were defined before TRITON_INTERPRET=1", allow_module_level=True)

CAP = 2.0   # q scaled so that scores (~N(0, 9)) are bent by it in both of tanh's regimes


def _case(reqs, *, heads, kv_heads, window, cap, dtype, seed, head=16, block_size=16):
    """Inputs for requests `(context, new tokens)` (decode-first, 2 padded tokens and 1 padded request)."""
    spec = LayerSpec(heads, kv_heads, head, head ** -0.5, window, logits_soft_cap=cap)
    T = sum(n for _, n in reqs)
    nb = 2 + sum(-(-(c + n) // block_size) for c, n in reqs)
    meta = make_batch(reqs, block_size=block_size, num_blocks=nb, max_blocks=8, T_pad=T + 2, R_pad=len(reqs) + 1,
                      seed=seed, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(T + 2, heads, head, generator=g)).to(DEVICE, dtype)
    k, v = (torch.randn(T + 2, kv_heads, head, generator=g).to(DEVICE, dtype) for _ in range(2))
    cache = torch.randn(2, nb, block_size, kv_heads, head, generator=g)
    poison_unused_slots(cache, meta, block_size)
    return spec, meta, q, k, v, cache.to(DEVICE, dtype), T


def _check(out, spec, meta, q, k, v, cache, T, dtype) -> None:
    """out[:T] within the bound of the float64 formula, not vacuously; padded rows zero; with a cap
    the uncapped attention is rejected (the cap is applied)."""
    p_dtype = None if dtype == torch.float32 else dtype    # P rounded to the inputs' dtype for P.V
    expected, bound = softcap_attention(q, k, v, cache, meta, spec, p_dtype=p_dtype, tanh_abs=2.0 ** -20)

    def check(o):
        assert_close_ulp(o, expected[:T], dtype, ulps=1, abs_err=bound[:T])

    assert_detects_errors(check, out[:T].cpu(), rel=0.02)
    assert torch.all(out[T:] == 0), "padded token rows must be zero"
    if spec.logits_soft_cap is not None:
        uncapped, _ = softcap_attention(q, k, v, cache, meta, dataclasses.replace(spec, logits_soft_cap=None))
        with pytest.raises(AssertionError):
            check(uncapped[:T])


@pytest.mark.parametrize("cap", [None, CAP], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_softcap_mixed_batch(cap, window, dtype):
    """Decodes, a fresh prefill and a chunked prefill in one (prefill-launch) step, GQA group 2."""
    spec, meta, q, k, v, cache, T = _case([(20, 1), (5, 1), (0, 9), (13, 6)], heads=4, kv_heads=2, window=window,
                                          cap=cap, dtype=dtype, seed=7)
    out = triton_paged_attention(q, k, v, cache.clone(), meta, spec)
    _check(out, spec, meta, q, k, v, cache, T, dtype)


@pytest.mark.parametrize("segments", [1, 4], ids=["single", "split"])
@pytest.mark.parametrize("window", [None, 9], ids=["full", "window"])
def test_softcap_decode(segments, window):
    """Decode-only steps (the decode launch), in one pass and split into segments merged by the
    combine kernel (some segments empty)."""
    spec, meta, q, k, v, cache, T = _case([(40, 1), (3, 1), (0, 1)], heads=4, kv_heads=1, window=window, cap=CAP,
                                          dtype=torch.float32, seed=11)
    tri_cache = cache.clone()
    triton_write_kv(tri_cache, k, v, meta.slot_mapping)
    out = unified_attention(q, tri_cache[0], tri_cache[1], meta.query_start_loc, meta.seq_lens, meta.block_tables,
                            spec, decode_only=True, segments=segments)
    _check(out, spec, meta, q, k, v, cache, T, torch.float32)


def test_softcap_must_be_positive():
    spec, meta, q, k, v, cache, _ = _case([(3, 1)], heads=2, kv_heads=2, window=None, cap=-1.0,
                                          dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        triton_paged_attention(q, k, v, cache, meta, spec)
