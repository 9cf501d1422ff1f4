"""The CUDA backend's fused Triton modules (RMSNorm, rotary, SiLU-and-mul) against the core's
references, within the roles' tolerance (`polyrunner.ops.cases`), and the override switch.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
the kernels are defined) on CPU tensors; with one they run compiled on it. The interpreter
truncates float32 -> bfloat16 where the GPU rounds to nearest, so bfloat16 results agree within
the tolerance, not bit for bit. Every comparison runs with the wrapped module's fallback made to
raise, so it is the kernel that is compared. Skipped, with the reason, where triton is not
installed.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from triton_setup import use_triton  # first: before any kernel module

HAS_CUDA = use_triton()

from polyrunner.backends.cuda.fused_modules import TritonGatedMLP, TritonRMSNorm, TritonRotary  # noqa: E402
from polyrunner.backends.cuda.op_overrides import cuda_op_overrides  # noqa: E402
from polyrunner.backends.cuda.triton_activation import silu_and_mul  # noqa: E402
from polyrunner.config import EngineConfig, ModelConfig  # noqa: E402
from polyrunner.ops import apply_overrides  # noqa: E402
from polyrunner.ops.cases import (  # noqa: E402
    Case,
    CaseSizes,
    compare,
    gated_mlp_cases,
    rms_norm_cases,
    rotary_cases,
)
from polyrunner.ops.gated_mlp import silu_and_mul as reference_silu_and_mul  # noqa: E402
from polyrunner.ops.rms_norm import RMSNorm  # noqa: E402
from polyrunner.ops.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and the kernels were defined before TRITON_INTERPRET=1", allow_module_level=True)
DTYPES = [torch.bfloat16, torch.float32]
# odd sizes: H=576 (SmolLM2) and 100, 80 rows, head sizes 64 and 128 over 6 query / 2 key-value heads
SIZES = CaseSizes(rows=(1, 80), hidden=(576, 100), intermediate=(100, 36), head_dims=(64, 128), heads=(6, 2))
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}


def _no_fallback(*args: object) -> None:
    raise AssertionError("the fused module fell back to the core's module")


def kernels_only(module: nn.Module) -> nn.Module:
    """`module` with the core module it wraps (if any) made to raise when called."""
    inner = getattr(module, "inner", None)
    if inner is not None:
        inner.forward = _no_fallback
    return module


def check_case(case: Case, fused: nn.Module, dtype: torch.dtype) -> int:
    """Every call of `case` on `fused` agrees with the reference; returns the outputs compared."""
    compared = 0
    for call in case.calls:
        ref, got = call.run(case.module), call.run(fused)
        assert len(got) == len(ref), call
        for name, g, r in zip(call.outputs, got, ref):
            ok, err, bound = compare(g, r, dtype)
            assert ok, f"{call.method} {call.shape} {name}: max error {err:.3g} > {bound:.3g} ({g.dtype}, {r.dtype})"
            compared += 1
    return compared


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    """forward and forward_add on [rows, H] and [rows, 4, D], rows 1 and 80, H 576 and 100."""
    compared = 0
    for case in rms_norm_cases(dtype, DEVICE, SIZES, gen()):
        fused = kernels_only(TritonRMSNorm(copy.deepcopy(case.module)))
        assert fused.weight.dtype == dtype and fused.eps == case.module.eps
        compared += check_case(case, fused, dtype)
    assert compared == 4 * 2 * 3   # 4 shapes x 2 row counts x (forward + forward_add's two outputs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_a_strided_view(dtype):
    """A q norm on `[T, Hq, D]` viewed out of one qkv projection, and a norm on `[T, D]` rows of
    a wider tensor: read through their strides, the tensors they view left as they were."""
    g = gen()
    T, hq, hkv, d = 80, 6, 2, 128
    norm = RMSNorm(d, 1e-6)
    norm.weight.data = (torch.randn(d, generator=g) * 0.3 + 1).to(dtype)
    norm = norm.to(DEVICE)
    qkv = (torch.randn(T, (hq + 2 * hkv) * d, generator=g) * 3).to(DEVICE, dtype)
    before = qkv.clone()
    for x in (qkv[:, :hq * d].view(T, hq, d), qkv[:, d:2 * d]):
        assert not x.is_contiguous()
        got = kernels_only(TritonRMSNorm(copy.deepcopy(norm)))(x)
        ok, err, bound = compare(got, norm(x), dtype)
        assert ok, f"{tuple(x.shape)}: max error {err:.3g} > {bound:.3g}"
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference(dtype):
    """q and k as strided views of one [T, (Hq + 2 Hkv) D] row, head sizes 64 and 128, rows 1 and 80."""
    compared = 0
    for case in rotary_cases(dtype, DEVICE, SIZES, gen()):
        fused = kernels_only(TritonRotary(copy.deepcopy(case.module)))
        assert torch.equal(fused.cos, case.module.cos) and torch.equal(fused.sin, case.module.sin)
        compared += check_case(case, fused, dtype)
    assert compared == 2 * 2 * 2   # 2 head sizes x 2 row counts x (q, k)


def rotate_in_qkv(rotary: nn.Module, positions: torch.Tensor, qkv: torch.Tensor, hq: int, hkv: int, d: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    q = qkv[:, :hq * d].view(-1, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
    return rotary(positions, q, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
def test_rotary_llama3_in_place(dtype, d):
    """llama3-scaled tables (folded in by the core), positions up to 2047: the kernel rotates q
    and k in place in the qkv projection, as the reference, and leaves v alone."""
    g = gen()
    T, hq, hkv, max_pos = 37, 6, 2, 2048
    rotary = RotaryEmbedding(d, max_pos, 500000.0, LLAMA3).to(DEVICE)
    plain = RotaryEmbedding(d, max_pos, 500000.0, None).to(DEVICE)
    assert (rotary.cos - plain.cos).abs().max() > 0.5   # the scaling changes the tables
    positions = torch.cat([torch.tensor([0, max_pos - 1]), torch.randint(0, max_pos, (T - 2,), generator=g)])
    positions = positions.to(DEVICE)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    ref_q, ref_k = rotate_in_qkv(rotary, positions, qkv.clone(), hq, hkv, d)
    fused_qkv = qkv.clone()
    q, k = rotate_in_qkv(kernels_only(TritonRotary(copy.deepcopy(rotary))), positions.to(torch.int32), fused_qkv,
                         hq, hkv, d)
    for got, ref, name in ((q, ref_q, "q"), (k, ref_k, "k")):
        ok, err, bound = compare(got, ref, dtype)
        assert ok, f"{name}: max error {err:.3g} > {bound:.3g}"
    assert q.data_ptr() == fused_qkv.data_ptr() and k.data_ptr() == fused_qkv.data_ptr() + hq * d * qkv.element_size()
    assert torch.equal(fused_qkv[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:])
    ok, _, _ = compare(fused_qkv[:, :hq * d].view(T, hq, d), qkv[:, :hq * d].view(T, hq, d), dtype)
    assert not ok   # q was rotated (not merely returned)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_mlp_matches_reference(dtype):
    compared = 0
    for case in gated_mlp_cases(dtype, DEVICE, SIZES, gen()):
        fused = TritonGatedMLP(copy.deepcopy(case.module))
        assert fused.intermediate == case.module.intermediate
        compared += check_case(case, fused, dtype)
    assert compared == 2 * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    """Leading dims kept, odd I (2500 spans two column blocks), rows of a wider tensor read through
    their stride; an odd last dim is refused."""
    g = gen()
    x = (torch.randn(3, 5, 2 * 2500, generator=g) * 4).to(DEVICE, dtype)
    wide = (torch.randn(7, 2 * 2500 + 24, generator=g) * 4).to(DEVICE, dtype)
    for inp in (x, wide[:, 24:]):
        got = silu_and_mul(inp)
        ok, err, bound = compare(got, reference_silu_and_mul(inp), dtype)
        assert ok and got.shape == (*inp.shape[:-1], 2500), f"max error {err:.3g} > {bound:.3g}"
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(x[..., :-1])


class _Tiny(nn.Module):
    """A one-layer model naming its modules by role, as the core's models do."""

    def __init__(self) -> None:
        super().__init__()
        from polyrunner.ops.gated_mlp import GatedMLP
        self.norm, self.rotary, self.mlp = RMSNorm(64, 1e-5), RotaryEmbedding(16, 32, 1e4, None), GatedMLP(64, 100)

    def replaceable_modules(self):
        yield "rms_norm", self, "norm", self.norm
        yield "rotary", self, "rotary", self.rotary
        yield "gated_mlp", self, "mlp", self.mlp


def test_overrides_follow_the_switches(monkeypatch):
    config = EngineConfig(model=ModelConfig())
    monkeypatch.delenv("POLYRUNNER_CUDA_FUSED", raising=False)
    monkeypatch.delenv("POLYRUNNER_CUDA_TRITON", raising=False)
    overrides = cuda_op_overrides(config, torch.bfloat16)
    assert sorted(overrides) == ["gated_mlp", "moe", "rms_norm", "rotary"]
    model = _Tiny()
    assert apply_overrides(model, overrides) == {"rms_norm": 1, "rotary": 1, "gated_mlp": 1, "moe": 0}
    assert isinstance(model.norm, TritonRMSNorm) and isinstance(model.rotary, TritonRotary)
    assert isinstance(model.mlp, TritonGatedMLP)
    assert cuda_op_overrides(config, torch.float64) == {}
    monkeypatch.setenv("POLYRUNNER_CUDA_FUSED", "0")
    assert cuda_op_overrides(config, torch.bfloat16) == {}
    monkeypatch.setenv("POLYRUNNER_CUDA_FUSED", "1")
    monkeypatch.setenv("POLYRUNNER_CUDA_TRITON", "0")
    assert cuda_op_overrides(config, torch.bfloat16) == {}
