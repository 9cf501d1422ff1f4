"""The Triton LoRA kernels (`backends/cuda/triton_lora.py`) and the CUDA "lora" override
(`backends/cuda/lora_module.py`): the device-side grouping's invariants, `add_lora_linear` against
the core's `add_lora` (mixed batches, tokens without an adapter, a slot without tokens, slots
outside [0, L), strided x rows, 1 to 3 output slices, ranks below max_rank), the override on the
role's cases, its registration with LoRA enabled, and both kernels compiled for sm_90 without spills.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before the
kernels are defined) on CPU tensors, bfloat16 dots through `triton_bf16_dot`; with a GPU they run
compiled on it. Tolerances are the roles' (`polyrunner.ops.cases.compare`). Skipped, with the
reason, where triton is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from triton_setup import use_triton  # first: before any kernel module

HAS_CUDA = use_triton(interpret=__name__ != "__main__")  # a subprocess compiling for sm_90 runs it

from polyrunner.backends.cuda.lora_module import TritonLoRALinear, triton_lora  # noqa: E402
from polyrunner.backends.cuda.op_overrides import cuda_op_overrides  # noqa: E402
from polyrunner.backends.cuda.triton_lora import add_lora_linear, launch_for, lora_groups  # noqa: E402
from polyrunner.config import EngineConfig, LoRAConfig, ModelConfig  # noqa: E402
from polyrunner.ops import apply_overrides  # noqa: E402
from polyrunner.ops.cases import CaseSizes, compare, lora_cases  # noqa: E402
from polyrunner.ops.lora import add_lora  # noqa: E402
from triton_bf16_dot import exact_bf16_dots  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
if __name__ != "__main__" and not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and the kernels were defined before TRITON_INTERPRET=1", allow_module_level=True)


def interpreted_dots() -> AbstractContextManager[None]:
    """Under the interpreter, bfloat16 dots made exact (`triton_bf16_dot`); compiled, nothing."""
    return nullcontext() if HAS_CUDA else exact_bf16_dots()


def test_groups_sort_tokens_by_slot_without_a_sync() -> None:
    token_lora = torch.tensor([2, -1, 0, 2, 5, 0, -3, 2], dtype=torch.int32, device=DEVICE)
    order, counts, starts = (t.cpu() for t in lora_groups(token_lora, 4))
    assert order.dtype == counts.dtype == starts.dtype == torch.int32
    assert counts.tolist() == [2, 0, 3, 0] and starts.tolist() == [0, 2, 2, 5]   # slot 1, 3: no token
    assert order[:5].tolist() == [2, 5, 0, 3, 7]                                  # by slot, token order kept
    assert sorted(order[5:].tolist()) == [1, 4, 6]                                # -1 and out of range: last


def _lora_weights(slots: int, inp: int, slices: tuple[int, ...], max_rank: int, ranks: tuple[int, ...],
                  dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_a, lora_b): slot l's adapter of rank ranks[l] (0: empty) in each slice's block, zero-padded."""
    sr, out = len(slices) * max_rank, sum(slices)
    a, b = torch.zeros(slots, sr, inp), torch.zeros(slots, out, sr)
    col = 0
    for i, width in enumerate(slices):
        for slot, r in enumerate(ranks):
            a[slot, i * max_rank:i * max_rank + r] = torch.randn(r, inp, generator=g) * inp ** -0.5
            scale = max(r, 1) ** -0.5
            b[slot, col:col + width, i * max_rank:i * max_rank + r] = torch.randn(width, r, generator=g) * scale
        col += width
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


# (T, in, output_slices, max_rank, ranks per slot, mapping): mixed batches, one slot only, none,
# out-of-range slots, a rank of 1 padded to tl.dot's 16, T past the small launch's block_m
KERNEL_CASES = [(7, 40, (24,), 16, (4, 16, 0), "mixed"), (13, 64, (32, 32), 8, (8, 1, 4), "mixed"),
                (9, 48, (48, 12, 12), 16, (16, 8, 4), "one"), (5, 32, (20, 8, 8), 8, (8, 8, 8), "none"),
                (6, 32, (40,), 8, (2, 8, 0), "outside"), (70, 32, (16, 16), 16, (16, 4, 8), "mixed"),
                (1, 32, (16,), 1, (1, 0, 1), "one")]


def _mapping(kind: str, t: int, slots: int, g: torch.Generator) -> torch.Tensor:
    if kind == "one":
        return torch.full((t,), slots - 1, dtype=torch.int32)
    if kind == "none":
        return torch.full((t,), -1, dtype=torch.int32)
    if kind == "outside":
        return torch.tensor([slots, -1, -7, 0, slots + 3, 1][:t], dtype=torch.int32)
    return torch.randint(-1, slots - 1, (t,), generator=g).to(torch.int32)   # the last slot gets no token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,inp,slices,max_rank,ranks,kind", KERNEL_CASES)
def test_add_lora_linear_matches_the_reference(t: int, inp: int, slices: tuple[int, ...], max_rank: int,
                                               ranks: tuple[int, ...], kind: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(t * 100 + inp)
    lora_a, lora_b = _lora_weights(len(ranks), inp, slices, max_rank, ranks, dtype, g)
    x = torch.randn(t, inp + 8, generator=g).to(DEVICE, dtype)[:, 8:]   # rows read through their stride
    y = torch.randn(t, sum(slices), generator=g).to(DEVICE, dtype)
    token_lora = _mapping(kind, t, len(ranks), g).to(DEVICE)
    want = add_lora(y, x, lora_a, lora_b, token_lora)
    with interpreted_dots():
        got = add_lora_linear(y.clone(), x, lora_a, lora_b, token_lora, slices)
    ok, err, bound = compare(got, want, dtype)
    assert ok, f"{launch_for(t, lora_a.shape[1], inp, max_rank, dtype)}: max error {err:.3g} > {bound:.3g}"
    if kind == "none":
        assert torch.equal(got, y)
    else:   # the adapters matter: without them the result is off by more than the tolerance
        assert not compare(y, want, dtype)[0]


def test_no_tokens_and_bad_inputs() -> None:
    x, y = torch.randn(0, 32), torch.randn(0, 16)
    a, b, tl_ = torch.zeros(2, 8, 32), torch.zeros(2, 16, 8), torch.zeros(0, dtype=torch.int32)
    assert add_lora_linear(y, x, a, b, tl_, (16,)) is y
    x, y, tl_ = torch.randn(3, 32), torch.randn(3, 16), torch.zeros(3, dtype=torch.int32)
    bad: list[tuple[str, tuple[Any, ...]]] = [
        ("x must be", (y, x.double(), a, b, tl_, (16,))),
        ("lora_a must be", (y, x, torch.zeros(2, 8, 31), b, tl_, (16,))),
        ("y must be", (torch.randn(2, 16), x, a, b, tl_, (16,))),
        ("lora_b must be", (y, x, a, torch.zeros(2, 16, 4), tl_, (16,))),
        ("x's dtype", (y, x, a.half(), b, tl_, (16,))),
        ("token_lora must be", (y, x, a, b, tl_.float(), (16,))),
        ("output_slices must be", (y, x, a, b, tl_, (8, 4))),
        ("bounds must be", (y, x, a, b, tl_, (5, 5, 6))),
    ]
    for match, args in bad:
        with pytest.raises(ValueError, match=match):
            add_lora_linear(*args)


class _LoRAModel(nn.Module):
    """A LoRA linear named by role, as the core's models do with LoRA enabled."""

    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.proj = proj

    def replaceable_modules(self) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
        yield "lora", self, "proj", self.proj


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lora_is_the_lora_override(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """With LoRA enabled `cuda_op_overrides` replaces the "lora" role by TritonLoRALinear, which keeps
    the reference's attributes and parameters and matches it on the role's cases."""
    monkeypatch.delenv("POLYRUNNER_CUDA_FUSED", raising=False)
    monkeypatch.delenv("POLYRUNNER_CUDA_TRITON", raising=False)
    assert "lora" not in cuda_op_overrides(EngineConfig(model=ModelConfig()), dtype)
    overrides = cuda_op_overrides(EngineConfig(model=ModelConfig(), lora=LoRAConfig(max_loras=3)), dtype)
    assert overrides["lora"] is triton_lora
    compared = 0
    sizes = CaseSizes(rows=(1, 13), hidden=(64, 40), intermediate=(32, 48))
    for case in lora_cases(dtype, DEVICE, sizes, torch.Generator().manual_seed(7)):
        original = copy.deepcopy(case.module)
        model = _LoRAModel(original)
        assert apply_overrides(model, {"lora": overrides["lora"]}) == {"lora": 1}
        lora = model.proj
        assert isinstance(lora, TritonLoRALinear)
        for attr in ("base", "lora_a", "lora_b", "mapping", "output_slices", "max_rank", "in_features"):
            assert getattr(lora, attr) is getattr(original, attr), attr
        for call in case.calls:
            with interpreted_dots():
                (got,) = call.run(lora)
            ok, err, bound = compare(got, call.run(case.module)[0], dtype)
            assert ok, f"{call.shape} slices {lora.output_slices}: max error {err:.3g} > {bound:.3g}"
            compared += 1
    assert compared == 2 * 3 * 2   # 2 size pairs x 3 slice layouts x 2 row counts
    assert triton_lora(nn.Linear(4, 4)).__class__ is nn.Linear


# --- compiled for sm_90 (a subprocess without the interpreter; tests/test_triton_compile.py's ptxas helper)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (name, dtype, tokens, S*R, in, R): a decode and a prefill launch in each dtype, qkv at rank 16 and 64
COMPILE_CASES = [(f"lora {dt} T={t} SR={sr} R={r}", dt, t, sr, k, r) for dt in ("bf16", "fp16", "fp32")
                 for t, sr, k, r in ((8, 48, 4096, 16), (512, 192, 4096, 64))]


def compile_all(arch: int) -> dict[str, dict[str, int]]:
    """Compile the shrink and expand kernels of every COMPILE_CASES launch for `cuda:arch`: name -> ptxas usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from polyrunner.backends.cuda.triton_lora import EXPAND_BLOCK_N, lora_expand_kernel, lora_shrink_kernel
    from test_triton_compile import ptxas_usage

    done: dict[str, dict[str, int]] = {}

    def build(name: str, fn: Any, types: dict[str, str], consts: dict[str, Any], divisible: tuple[str, ...]) -> None:
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()},
                        attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible})
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        done[name] = {**ptxas_usage(kernel.asm["ptx"], arch), "cubin": len(kernel.asm["cubin"]),
                      "shared": kernel.metadata.shared}

    groups = {"order_ptr": "*i32", "counts_ptr": "*i32", "starts_ptr": "*i32"}
    for name, dt, t, sr, k, r in COMPILE_CASES:
        launch = launch_for(t, sr, k, r, TORCH_DTYPES[dt])
        build(f"shrink {name}", lora_shrink_kernel, {"x_ptr": f"*{dt}", "a_ptr": f"*{dt}", "s_ptr": "*fp32", **groups},
              dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, IEEE=dt == "fp32"),
              ("x_ptr", "a_ptr", "s_ptr", "K", "SR", "stride_xm", "stride_al", "stride_an", "stride_sm"))
        build(f"expand {name}", lora_expand_kernel, {"s_ptr": "*fp32", "b_ptr": f"*{dt}", "y_ptr": f"*{dt}",
                                                      "bounds_ptr": "*i32", **groups},
              dict(BLOCK_M=launch.block_m, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=launch.block_r),
              ("s_ptr", "b_ptr", "y_ptr", "R", "stride_sm", "stride_bl", "stride_bn", "stride_ym"))
    return done


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, int]]:
    """compile_all(90), run in a subprocess without the interpreter."""
    spec = importlib.util.find_spec("triton")
    assert spec is not None and spec.submodule_search_locations is not None
    nvidia = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia"
    if not (nvidia / "bin" / "ptxas").exists():
        pytest.skip(f"this triton wheel ships no ptxas under {nvidia}/bin")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "90"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, dict[str, int]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_kernels_compile_for_sm90_without_spills(compiled: dict[str, dict[str, int]]) -> None:
    from test_triton_compile import SM90_SHARED

    assert sorted(compiled) == sorted(f"{kind} {c[0]}" for c in COMPILE_CASES for kind in ("shrink", "expand"))
    for name, report in compiled.items():
        assert report["cubin"] > 0 and report["regs"] > 0, (name, report)
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, f"{name} spills registers: {report}"
        assert report["shared"] <= SM90_SHARED, f"{name} needs more shared memory than sm_90 has: {report}"


if __name__ == "__main__":
    print(json.dumps(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
