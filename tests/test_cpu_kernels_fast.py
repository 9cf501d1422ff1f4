"""The CPU backend's newer C++ kernels against their PyTorch references:
AMX small-M linear (where the CPU has AMX), in-place rotary, fused residual
add + RMSNorm (each with the AVX-512 and the portable build: `cpu_kernels`)."""

from __future__ import annotations

import pytest
import torch

from polyrunner.backends.cpu import kernels
from tolerances import assert_close_ulp, assert_detects_errors, assert_linear_close, rms_norm_reference, unit_roundoff

needs_amx = pytest.mark.skipif(not kernels.amx_available(), reason=f"no AMX linear: {kernels.amx_unavailable_reason()}")


@needs_amx
@pytest.mark.parametrize("M", [1, 2, 15, 16, 17, 31, 32, 33, 48, 64, 65, 100, 257])
@pytest.mark.parametrize("N,K", [(16, 32), (48, 64), (960, 576), (576, 1536), (80, 96)])
def test_amx_linear_matches_matmul(M: int, N: int, K: int) -> None:
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / 8).to(torch.bfloat16)
    packed = kernels.amx_pack_bf16(w)
    y = kernels.amx_linear_bf16(x, packed, N)
    assert_linear_close(y, x, w)


@needs_amx
@pytest.mark.parametrize("M,K,aligned", [(1000, 1536, True), (1900, 576, True), (700, 1536, False)])
def test_amx_linear_row_blocks(M: int, K: int, aligned: bool) -> None:
    """Prefill-sized x runs as several row blocks (1 MiB of x each: 341 rows at K 1536, 910 at 576),
    the last one partial and ending in a tail of fewer than 16 rows; unaligned x is copied whole."""
    g = torch.Generator().manual_seed(M + K)
    flat = torch.randn(M * K + 1, generator=g).to(torch.bfloat16)
    x = flat[:-1].view(M, K) if aligned else flat[1:].view(M, K)
    assert (x.data_ptr() % 64 == 0) == aligned
    w = (torch.randn(96, K, generator=g) / 8).to(torch.bfloat16)
    assert_linear_close(kernels.amx_linear_bf16(x, kernels.amx_pack_bf16(w), 96), x, w)


@needs_amx
def test_amx_linear_strided_rows_and_declines() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)[:, :64]  # row stride 128
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    y = kernels.amx_linear_bf16(x, kernels.amx_pack_bf16(w), 32)
    assert_linear_close(y, x, w)
    assert kernels.amx_pack_bf16(torch.randn(24, 64, generator=g).to(torch.bfloat16)) is None  # N % 16
    assert kernels.amx_pack_bf16(torch.randn(32, 40, generator=g).to(torch.bfloat16)) is None  # K % 32
    big = torch.randn(77, 192, generator=g).to(torch.bfloat16)[:, 64:128]  # prefill-sized, strided, 13-row tail
    assert_linear_close(kernels.amx_linear_bf16(big, kernels.amx_pack_bf16(w), 32), big, w)
    flat = torch.randn(40 * 65 + 1, generator=g).to(torch.bfloat16)
    odd = flat[1:].view(40, 65)[:, :64]   # not 64-byte aligned (offset 2 bytes, stride 130): copied whole
    assert odd.data_ptr() % 64 and odd.stride(0) == 65
    assert_linear_close(kernels.amx_linear_bf16(odd, kernels.amx_pack_bf16(w), 32), odd, w)
    assert kernels.amx_linear_bf16(x.float(), kernels.amx_pack_bf16(w), 32) is None   # not bfloat16


@needs_amx
def test_packed_linear_runs_its_plan_per_row_count() -> None:
    from polyrunner.backends.cpu.packed_linear import PackedLinear, packing_supported
    if not packing_supported(torch.bfloat16):
        pytest.skip("oneDNN bfloat16 packing unavailable on this CPU")
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(192, 128, generator=g) / 8).to(torch.bfloat16)
    lin = PackedLinear(w, None, 64, ("amx",) * 33 + ("onednn",))   # AMX up to 32 rows, oneDNN above
    assert lin.pool_rows == 32
    x = torch.randn(80, 128, generator=g).to(torch.bfloat16)
    assert_linear_close(lin(x), x, w)          # oneDNN
    assert_linear_close(lin(x[:7]), x[:7], w)  # AMX


@pytest.mark.parametrize("T", [1, 5, 130])
@pytest.mark.parametrize("D", [64, 128, 80])
def test_fused_rotary_is_exact(cpu_kernels, T: int, D: int) -> None:
    from polyrunner.backends.cpu.fused_modules import FusedRotary
    from polyrunner.ops import RotaryEmbedding
    rotary = RotaryEmbedding(D, 2048, 10000.0, None)
    Hq, Hk = 4, 2
    g = torch.Generator().manual_seed(T * 1000 + D)
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, generator=g) * 3).to(torch.bfloat16)
    q, k, _ = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k = q.view(T, Hq, D), k.view(T, Hk, D)
    positions = torch.randint(0, 2048, (T,), generator=g)
    ref_q, ref_k = rotary(positions, q, k)
    got_q, got_k = FusedRotary(rotary)(positions.to(torch.int32), q, k)  # in place on the views
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert got_q.data_ptr() == q.data_ptr()


@pytest.mark.parametrize("T", [1, 5, 130])
@pytest.mark.parametrize("D", [64, 128, 80])
def test_fused_rotary_float32_is_torchs_math(cpu_kernels, T: int, D: int) -> None:
    """float32: x * cos + rotate_half(x) * sin within float32's roundings (two products and a sum)
    of the float64 rotation, in place, as the module computes it up to those roundings."""
    from polyrunner.backends.cpu.fused_modules import FusedRotary
    from polyrunner.ops import RotaryEmbedding
    rotary = RotaryEmbedding(D, 2048, 10000.0, None)
    Hq, Hk = 4, 2
    g = torch.Generator().manual_seed(T * 1000 + D)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g) * 3
    q, k, _ = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k = q.view(T, Hq, D), k.view(T, Hk, D)
    positions = torch.randint(0, 2048, (T,), generator=g)
    cos, sin = (rotary.cos[positions].double()[:, None], rotary.sin[positions].double()[:, None])
    want, bound = [], []
    for x in (q, k):
        x = x.double()
        half = torch.cat([-x[..., D // 2:], x[..., :D // 2]], dim=-1)
        want.append(x * cos + half * sin)
        bound.append((x * cos).abs() + (half * sin).abs())
    module = rotary(positions, q.clone(), k.clone())
    got = FusedRotary(rotary)(positions, q, k)
    assert got[0].data_ptr() == q.data_ptr() and got[1].data_ptr() == k.data_ptr()
    for y, m, w, b in zip(got, module, want, bound):
        def check(out, w=w, b=b):
            assert_close_ulp(out, w, torch.float32, ulps=1, abs_err=b * 2 * unit_roundoff(torch.float32))

        check(m)
        assert_detects_errors(check, y)


@pytest.mark.parametrize("T", [1, 3, 200])
@pytest.mark.parametrize("H", [576, 100])  # 100: the vector loop's scalar tail
def test_fused_float32_norms_and_silu_mul(cpu_kernels, T: int, H: int) -> None:
    """float32: the fused residual add is torch's bit for bit; the norm within float32's roundings of the
    float64 RMSNorm of that sum; silu(gate) * up within exp's 2^-20 and four roundings of float64."""
    from polyrunner.backends.cpu.fused_modules import FusedRMSNorm
    from polyrunner.ops import RMSNorm
    g = torch.Generator().manual_seed(T * 1000 + H)
    norm = RMSNorm(H, 1e-5)
    norm.weight.data = torch.rand(H, generator=g) + 0.5
    x, residual = torch.randn(T, H, generator=g) * 4, torch.randn(T, H, generator=g)
    out, res = FusedRMSNorm(norm).forward_add(x, residual)
    assert torch.equal(res, x + residual)
    ref, bound = rms_norm_reference(res, norm.weight, 1e-5, torch.float32)

    def check(y):
        assert_close_ulp(y, ref, torch.float32, ulps=1, abs_err=bound)

    check(norm(res))                 # the module itself meets the bound
    assert_detects_errors(check, out)
    assert_detects_errors(check, FusedRMSNorm(norm)(res))
    gate_up = torch.randn(T, 2 * H, generator=g) * 4
    gate, up = gate_up.double().split(H, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    h_bound = want.abs() * (2.0 ** -20 + 4 * unit_roundoff(torch.float32))

    def check_h(h):
        assert_close_ulp(h, want, torch.float32, ulps=1, abs_err=h_bound)

    check_h(torch.nn.functional.silu(gate_up[:, :H]) * gate_up[:, H:])   # the module's own
    assert_detects_errors(check_h, kernels.silu_mul(gate_up))


@pytest.mark.parametrize("T", [1, 3, 200])
@pytest.mark.parametrize("H", [576, 100])  # 100: the vector loop's scalar tail
def test_fused_add_rms_norm_matches_module(cpu_kernels, T: int, H: int) -> None:
    """The fused residual add is torch's bit for bit (the same float32 add, rounded to bfloat16);
    the norm, like the module's own, is within its two bfloat16 roundings of the float64 RMSNorm
    of that sum (`rms_norm_reference`). The kernel and the module may differ from each other by
    2 ulps (each rounds float32 values summed in its own order), so they are not compared
    with each other: a tolerance between them would sit at the edge of bfloat16 rounding."""
    from polyrunner.backends.cpu.fused_modules import FusedRMSNorm
    from polyrunner.ops import RMSNorm
    g = torch.Generator().manual_seed(T * 1000 + H)
    norm = RMSNorm(H, 1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16)
    x = (torch.randn(T, H, generator=g) * 4).to(torch.bfloat16)
    residual = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ref_out, ref_res = norm.forward_add(x, residual)
    out, res = FusedRMSNorm(norm).forward_add(x, residual)
    assert torch.equal(res, ref_res)
    ref, bound = rms_norm_reference(ref_res, norm.weight, 1e-5)

    def check(y):
        assert_close_ulp(y, ref, torch.bfloat16, ulps=1, abs_err=bound)

    check(ref_out)                   # the module itself meets the bound
    assert_detects_errors(check, out)


def test_decoder_layers_return_output_and_residual() -> None:
    """The model's residual hand-off (layer -> next norm's forward_add) sums to
    the plain `x + attn; x + mlp` layer output."""
    from polyrunner.ops import RMSNorm
    norm = RMSNorm(8, 1e-6)
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    out, res = norm.forward_add(x, residual)
    assert torch.equal(res, x + residual)
    assert torch.equal(out, norm(x + residual))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [7, 64, 300])
def test_fused_elementwise_kernels_split_rows_on_the_pool(cpu_kernels, T: int, dtype: torch.dtype) -> None:
    """RMSNorm, residual add + RMSNorm, SiLU * up and rotary split their rows between threads:
    on OpenMP's team (prefill steps) or on the kernel pool when torch has one thread (decode-sized
    steps, `thread_pool.h` `for_rows`). Rows are independent, so every split gives one thread's bits."""
    from polyrunner.ops import RotaryEmbedding
    g = torch.Generator().manual_seed(T)
    H, inter, Hq, Hk, D = 576, 1536, 9, 3, 64
    x, res = (torch.randn(T, H, generator=g) * 3).to(dtype), torch.randn(T, H, generator=g).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    gate_up = (torch.randn(T, 2 * inter, generator=g) * 2).to(dtype)
    qk = torch.randn(T, Hq + Hk, D, generator=g).to(dtype)
    positions = torch.randint(0, 2048, (T,), generator=g)
    rotary = RotaryEmbedding(D, 2048, 10000.0, None)
    cos, sin = rotary.cos.float().contiguous(), rotary.sin.float().contiguous()

    def run() -> list[torch.Tensor]:
        q, k = qk[:, :Hq].clone(), qk[:, Hq:].clone()
        outs = [kernels.rms_norm(x, w, 1e-5), *kernels.add_rms_norm(x, res, w, 1e-5),
                kernels.silu_mul(gate_up)]
        kernels.rotary_(positions, q, k, cos, sin)
        return [*outs, q, k]

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        kernels.start_pool(1)
        serial = run()
        kernels.start_pool(2)            # decode-sized steps: the pool splits the rows
        pooled = run()
        torch.set_num_threads(2)         # prefill steps: OpenMP's team does
        team = run()
    finally:
        torch.set_num_threads(saved)
    for a, b, c in zip(serial, pooled, team):
        assert torch.equal(a, b) and torch.equal(a, c)
