"""GGUF-quantized linear kernels (backends/cpu/quant_gemm.cpp, quant_kquants.cpp, quant_kquants_r8.cpp,
quant_small.cpp, quant_small_r8.cpp) against a dequantised reference, for every GGUF type they run: Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS.

The reference is `gguf.quants.dequantize` (llama.cpp's Python package) of the
same blocks, multiplied in float64. Two bounds, both checked for every type,
both kernel builds, every instruction-set path and both weight layouts (the
GGUF blocks as they are, and the row-interleaved "r8" copy of every type but Q2_K
and Q3_K on the SIMD paths, of Q8_0 on the VNNI ones only); paths the CPU lacks are
skipped with the reason:

- against the activations as the kernel quantizes them (int8 blocks of 32, scale
  max|x| / 127, `pr_quant_quantize_row`): the integer sums are exact, so the output
  differs only by float32 accumulation, at most `gamma(K + 8)` times the sum of the
  magnitudes of every part of every product (`quant_blocks.magnitude_weights`: the
  scale and the offset or min parts of a weight separately), plus one rounding to
  the output dtype;
- against the float activations: in addition, half an int8 step per activation,
      |y - ref| <= sum over blocks b of (max|x_b| / 254) * sum_{i in b} |w_i|.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from polyrunner.backends.cpu import kernels  # noqa: E402
from polyrunner.backends.cpu import quant_linear as ql  # noqa: E402 - after importorskip
from quant_blocks import OFFSET, magnitude_weights, parts, random_blocks  # noqa: E402
from tolerances import assert_close_ulp, assert_detects_errors, gamma  # noqa: E402

QTYPES = list(ql.QTYPES)
R8_TYPES = set(QTYPES) - {"Q8_0", "Q2_K", "Q3_K"}  # r8 on every SIMD path (Q8_0: the VNNI paths only)
# "vnni_emulated": the VNNI paths' code with `vpdpbusd` emulated in AVX2 (kernels.VARIANTS), run on every
# AVX2 CPU; the native VNNI paths run where the CPU has them
PATHS = [(variant, isa) for variant in ("native", "portable") for isa in ql.ISAS]
PATHS += [("vnni_emulated", isa) for isa in ("avxvnni", "avx512vnni")]


def expects_r8(qtype: str, isa: str) -> bool:
    return isa != "scalar" and (qtype in R8_TYPES or (qtype == "Q8_0" and isa in ("avxvnni", "avx512vnni")))


def reference(qtype: str, blocks: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W^T in float64 with W dequantised by gguf, the error bound before the output's rounding:
    activation rounding, half an int8 step per activation, plus float32 accumulation of every
    part of every product, in any order)."""
    w = gguf.quants.dequantize(blocks, Q[qtype]).astype(np.float64)
    ref = x @ w.T
    amax = np.abs(x).reshape(x.shape[0], -1, 32).max(-1)               # [M, K/32]
    wabs = np.abs(w).reshape(w.shape[0], -1, 32).sum(-1)               # [N, K/32]
    rounding = (amax / 254) @ wabs.T
    accumulation = gamma(x.shape[1] + 8) * (np.abs(x) @ magnitude_weights(qtype, blocks).T + rounding)
    return ref, rounding + accumulation


def quantized_reference(lib, qtype: str, blocks: np.ndarray, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(xq @ W^T in float64, xq = x as the kernels quantize it (q * d per block of 32); the bound of
    float32 accumulation of every part of every product, in any order)."""
    q, d, _, _ = quantize_rows(lib, False, x)
    xq = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)
    w = gguf.quants.dequantize(blocks, Q[qtype]).astype(np.float64)
    return xq @ w.T, gamma(x.shape[1] + 8) * (np.abs(xq) @ magnitude_weights(qtype, blocks).T)


def activations(rng: np.random.Generator, M: int, K: int) -> np.ndarray:
    x = rng.standard_normal((M, K)) * rng.uniform(0.1, 10, size=(M, 1))
    x[0, :32] = 0.0                       # an all-zero block (scale 0)
    if M > 2:
        x[2] *= 1e3                       # a large row
    return x.astype(np.float32)


def library_or_skip(variant: str, isa: str):
    lib = kernels.load_library(variant)
    if lib is None:
        pytest.skip(f"no {variant} kernel library (no C++ compiler?)")
    why = ql.isa_unavailable_reason(isa, lib)
    if why is not None:
        pytest.skip(f"{variant} build, {isa}: {why}")
    return lib


@pytest.mark.parametrize("variant,isa", PATHS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_within_activation_rounding_of_the_dequantised_reference(variant, isa, qtype):
    lib = library_or_skip(variant, isa)
    rng = np.random.default_rng([QTYPES.index(qtype), list(ql.ISAS).index(isa)])
    N, K = 40, 512
    blocks = random_blocks(rng, qtype, N, K)
    layouts = [(torch.from_numpy(blocks), False)]
    if ql.r8_supported(qtype, (N, K), isa, lib):
        assert expects_r8(qtype, isa), f"{qtype} on {isa} runs an r8 layout this test does not expect"
        layouts.append((ql.repack8(qtype, layouts[0][0], K, lib), True))
    elif expects_r8(qtype, isa):
        pytest.fail(f"{qtype} on {isa} should run the r8 layout")
    for M in (1, 2, 3, 4, 5, 9):      # every register tile size, and tails
        x = activations(rng, M, K)
        for out_dtype in (torch.float32, torch.bfloat16):
            for x_dtype in (torch.float32, torch.bfloat16):
                xt = torch.from_numpy(x).to(x_dtype)
                xr = xt.float().numpy().astype(np.float64)
                ref, bound = reference(qtype, blocks, xr)
                qref, qbound = quantized_reference(lib, qtype, blocks, xt)
                for w, r8 in layouts:
                    y = ql.quant_matmul(qtype, w, K, xt, out_dtype, isa, lib, r8)
                    assert y.dtype == out_dtype and y.shape == (M, N)
                    what = f"M={M} r8={r8} out {out_dtype} x {x_dtype}: "
                    assert_close_ulp(y, torch.from_numpy(ref), out_dtype, ulps=1, abs_err=torch.from_numpy(bound),
                                     msg=what)
                    assert_close_ulp(y, torch.from_numpy(qref), out_dtype, ulps=1,
                                     abs_err=torch.from_numpy(qbound), msg=f"{what}(quantized x) ")
    # the quantized-activation bound is tight: an output 1% off fails it
    assert_detects_errors(lambda y: assert_close_ulp(y, torch.from_numpy(qref), torch.float32, ulps=1,
                                                     abs_err=torch.from_numpy(qbound)),
                          ql.quant_matmul(qtype, layouts[-1][0], K, xt, torch.float32, isa, lib, layouts[-1][1]))


@pytest.mark.parametrize("qtype", sorted(R8_TYPES))
def test_r8_layout_keeps_the_gguf_bytes_per_weight(qtype):
    """Every r8 copy holds exactly the GGUF bytes (a decode step streams no more than the file's bits
    per weight, and the process holds no more than the file: Q4_K's and Q4_0's first r8 layouts,
    with float scales per block, took 1.33x and 1.11x)."""
    lib = library_or_skip("native", "avx2")
    N, K = 16, 512
    blocks = torch.from_numpy(random_blocks(np.random.default_rng(2), qtype, N, K))
    assert ql.repack8(qtype, blocks, K, lib).numel() == blocks.numel()


@pytest.mark.parametrize("qtype", QTYPES)
def test_block_parts_decode_like_gguf(qtype):
    """The bounds' decoder (tests/quant_blocks.py) gives gguf's weights: S * (v - o) - m, float64,
    equals `gguf.quants.dequantize` (float32) to its rounding."""
    blocks = random_blocks(np.random.default_rng(5), qtype, 16, 512)
    S, v, m = parts(qtype, blocks)
    want = gguf.quants.dequantize(blocks, Q[qtype]).astype(np.float64)
    np.testing.assert_allclose(S * (v - OFFSET.get(qtype, 0)) - m, want, rtol=2.0 ** -23, atol=0)


@pytest.mark.parametrize("qtype", QTYPES)
def test_paths_agree_and_dequantize_is_exact(qtype):
    """Every path sums the same integers: they agree to float32 rounding; the C++ dequantiser
    equals gguf's exactly (float32) and to one rounding (bfloat16)."""
    rng = np.random.default_rng(7)
    N, K = 24, 768 if gguf.GGML_QUANT_SIZES[Q[qtype]][0] == 32 else 512
    blocks = random_blocks(rng, qtype, N, K)
    x = torch.from_numpy(activations(rng, 6, K))
    outs = {}
    for variant, isa in PATHS:
        lib = kernels.load_library(variant)
        if lib is not None and ql.isa_unavailable_reason(isa, lib) is None:
            outs[variant, isa] = ql.quant_matmul(qtype, torch.from_numpy(blocks), K, x, torch.float32, isa, lib)
            if ql.r8_supported(qtype, (N, K), isa, lib):
                w8 = ql.repack8(qtype, torch.from_numpy(blocks), K, lib)
                outs[variant, isa, "r8"] = ql.quant_matmul(qtype, w8, K, x, torch.float32, isa, lib, r8=True)
                d8 = ql.dequantize(qtype, w8, K, torch.float32, lib, r8=True)
                np.testing.assert_array_equal(d8.numpy(), gguf.quants.dequantize(blocks, Q[qtype]))
    assert ("portable", "avx2") in outs or not kernels._X86, "the AVX2 path must run on every x86 CPU"
    base = outs["native", "scalar"]
    # the same integer sums and scales; float32 rounding of the parts' magnitudes, twice (each path's own)
    mag = torch.from_numpy(x.double().abs().numpy() @ magnitude_weights(qtype, blocks).T)
    for key, y in outs.items():
        assert_close_ulp(y, base, torch.float32, ulps=0, abs_err=2 * gamma(K + 8) * mag, msg=f"{key}: ")
    want = gguf.quants.dequantize(blocks, Q[qtype])
    got = ql.dequantize(qtype, torch.from_numpy(blocks), K, torch.float32)
    np.testing.assert_array_equal(got.numpy(), want)
    got16 = ql.dequantize(qtype, torch.from_numpy(blocks), K, torch.bfloat16)
    assert torch.equal(got16, torch.from_numpy(want).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_linear_module_decode_and_prefill_paths(qtype):
    """Small steps run the integer kernel, large ones dequantise + dense matmul; bias and 3-D inputs."""
    rng = np.random.default_rng(3)
    g = torch.Generator().manual_seed(3)
    N, K = 48, 256
    blocks = torch.from_numpy(random_blocks(rng, qtype, N, K))
    bias = torch.randn(N, generator=g)
    mod = ql.QuantLinear(qtype, blocks, (N, K), bias)
    assert mod.r8 == expects_r8(qtype, ql.default_isa())
    for M in (1, ql.PREFILL_ROWS, ql.PREFILL_ROWS + 1, 100):   # integer kernel; dequantised dense matmul
        x = torch.randn(M, K, generator=g)
        ref, bound = reference(qtype, blocks.numpy(), x.double().numpy())
        want = torch.from_numpy(ref) + bias.double()
        bound = torch.from_numpy(bound) + gamma(K + 9) * bias.double().abs()   # + the bias add
        # int8 activations: the worst case is ~10% of a typical output here, so a 20% error must fail
        assert_detects_errors(lambda y, want=want, bound=bound: assert_close_ulp(y, want, torch.float32, ulps=1,
                                                                                 abs_err=bound), mod(x),
                              rel=0.2)
    x3 = torch.randn(2, 5, K, generator=g)
    assert mod(x3).shape == (2, 5, N)
    xb = torch.randn(100, K, generator=g).to(torch.bfloat16)
    assert mod(xb).dtype == torch.bfloat16
    assert ql.QuantLinear("Q8_0", torch.from_numpy(random_blocks(rng, "Q8_0", N, K)), (N, K),
                          out_dtype=torch.float32)(xb[:2]).dtype == torch.float32


def quantize_rows(lib, simd: bool, x: torch.Tensor) -> tuple[np.ndarray, ...]:
    """`pr_quant_quantize_row` on each row of x: (q, d, d * sum(q), sum(q)) per block of 32."""
    fn = lib.pr_quant_quantize_row
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 4
    M, K = x.shape
    q, d, s, n = (np.zeros((M, K), np.int8), np.zeros((M, K // 32), np.float32), np.zeros((M, K // 32), np.float32),
                  np.zeros((M, K // 32), np.int32))
    for m in range(M):
        row = x[m].contiguous()
        assert fn(int(simd), row.data_ptr(), int(x.dtype == torch.bfloat16), K, q[m].ctypes.data, d[m].ctypes.data,
                  s[m].ctypes.data, n[m].ctypes.data) == 0
    return q, d, s, n


@pytest.mark.parametrize("variant", ["native", "portable"])
def test_activation_quantization_simd_equals_scalar_and_the_formula(variant):
    """The AVX2 activation quantizer (every step's input to every quantized linear) gives the scalar
    loop's blocks bit for bit: q = round-half-even(x * (127 / max|x|)), d = max|x| / 127, in float32;
    rows with exact .5 ties, zero blocks, tiny and huge magnitudes, float32 and bfloat16 inputs
    (d to a rounding: the build may divide by 127 as a multiply)."""
    lib = kernels.load_library(variant)
    if lib is None:
        pytest.skip(f"no {variant} kernel library (no C++ compiler?)")
    rng = np.random.default_rng(11)
    K = 256
    x = rng.standard_normal((6, K)).astype(np.float32) * np.float32([[1], [1e-30], [1e30], [3], [1], [1]])
    x[3, :32] = 0.0
    x[4, 0], x[4, 1:32] = 127, np.arange(31) - 15 + 0.5      # max 127: x * 127 / max = x, all .5 ties
    x[4, 32:64] = np.float32(127) * (np.arange(32) - 15.5) / 16.5
    x[5] = np.float32(2.0) ** rng.integers(-8, 8, K)          # powers of two: exact products
    for dtype in (torch.float32, torch.bfloat16):
        xt = torch.from_numpy(x).to(dtype)
        scalar = quantize_rows(lib, False, xt)
        if kernels._X86:
            for a, b in zip(quantize_rows(lib, True, xt), scalar):
                np.testing.assert_array_equal(a, b)
        xf = xt.float().numpy().reshape(6, -1, 32)
        amax = np.abs(xf).max(-1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
        want_q = np.rint((xf * inv).astype(np.float32)).astype(np.int8).reshape(6, K)
        np.testing.assert_array_equal(scalar[0], want_q)
        np.testing.assert_allclose(scalar[1], amax[..., 0] / np.float32(127), rtol=2.0 ** -23)  # (reciprocal ok)
        np.testing.assert_array_equal(scalar[3], want_q.reshape(6, -1, 32).astype(np.int32).sum(-1))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="GGUF type 'IQ2_XXS' has no CPU kernel; allowed: Q4_0, Q4_1, Q5_0, Q5_1, "
                                         "Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS"):
        ql.QuantLinear("IQ2_XXS", torch.zeros(4, 66, dtype=torch.uint8), (4, 256))
    blocks = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"x must be float32/bfloat16 \[M, 32\]"):
        ql.quant_matmul("Q4_1", blocks, 32, torch.zeros(2, 64))
    with pytest.raises(ValueError, match="unknown instruction-set path 'sse9'; allowed: scalar, avx2"):
        ql.isa_unavailable_reason("sse9")


def test_forced_path_env(monkeypatch):
    monkeypatch.setenv("POLYRUNNER_CPU_QUANT_ISA", "avx2" if kernels._X86 else "scalar")
    assert ql.default_isa() == ("avx2" if kernels._X86 else "scalar")
    portable = kernels.load_library("portable")
    if portable is not None and kernels._X86:
        monkeypatch.setenv("POLYRUNNER_CPU_QUANT_ISA", "avx512vnni")
        with pytest.raises(ValueError, match="POLYRUNNER_CPU_QUANT_ISA=avx512vnni: this kernel build has no"):
            ql.default_isa(portable)
        monkeypatch.delenv("POLYRUNNER_CPU_QUANT_ISA")
        assert ql.default_isa(portable) in ("avx2", "scalar")
