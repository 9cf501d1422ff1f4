"""The Triton fused-MoE kernel (`backends/cuda/triton_moe.py`) and its grouping
(`moe_align.py`): the alignment's invariants, `fused_experts` against a dense torch reference
written here (every expert on every token, then the routed ones picked), and the launch
table's entries compiled for sm_90 without spills.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here before
the kernels are defined) on CPU tensors, bfloat16 dots through `triton_bf16_dot` (the
interpreter multiplies bfloat16 bits as integers); with a GPU they run compiled on it.
Tolerances are the roles' (`polyrunner.ops.cases.compare`). Skipped, with the reason, where
triton is not installed.
"""

from __future__ import annotations

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
import torch.nn.functional as F
from torch import nn

from triton_setup import use_triton  # first: before any kernel module

HAS_CUDA = use_triton(interpret=__name__ != "__main__")  # a subprocess compiling for sm_90 runs it

from polyrunner.backends.cuda.moe_align import (  # noqa: E402
    max_num_m_blocks,
    max_num_tokens_padded,
    moe_align_block_size,
)
from polyrunner.backends.cuda.moe_launch import TABLE, MoELaunch, launch_for, regime  # noqa: E402
from polyrunner.backends.cuda.moe_module import TritonFusedMoE  # noqa: E402
from polyrunner.backends.cuda.op_overrides import cuda_op_overrides  # noqa: E402
from polyrunner.backends.cuda.triton_moe import fused_experts  # noqa: E402
from polyrunner.config import EngineConfig, ModelConfig  # noqa: E402
from polyrunner.ops import apply_overrides  # noqa: E402
from polyrunner.ops.cases import CaseSizes, compare, moe_cases  # noqa: E402
from triton_bf16_dot import exact_bf16_dots  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
if __name__ != "__main__" and not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and the kernels were defined before TRITON_INTERPRET=1", allow_module_level=True)


def routing(kind: str, T: int, E: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32, topk_ids int32) [T, k]: distinct experts per token from random
    logits; "skip": expert 1 receives no token; "one": every token's first choice is expert E-1
    (with k == 1: every pair goes to it); "all": k == E, every token to every expert."""
    logits = torch.randn(T, E, generator=g)
    if kind == "skip":
        logits[:, 1] = -1e9
    elif kind == "one":
        logits[:, E - 1] = 1e9
    elif kind == "all":
        assert k == E
    weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    weights = torch.rand(T, k, generator=g) + 0.1   # routing weights of any scale (not renormalised)
    return weights, ids.to(torch.int32)


# (routing, T, E, k): the three M regimes of the launch table, a decode step, and the edge routings
ALIGN_CASES = [("skip", 20, 8, 2), ("one", 13, 4, 1), ("one", 9, 6, 3), ("all", 7, 4, 4), ("skip", 1, 8, 3),
               ("random", 0, 4, 2), ("random", 300, 8, 2)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kind,T,E,k", ALIGN_CASES)
def test_align_groups_every_pair_once_padded_per_expert(kind: str, T: int, E: int, k: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(T * 100 + E * 10 + k)
    ids = routing(kind, T, E, k, g)[1]
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids.to(DEVICE), block_size, E)
    sorted_ids, expert_ids, num_post = sorted_ids.cpu(), expert_ids.cpu(), num_post.cpu()
    pairs = T * k
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32 and num_post.shape == (1,)
    assert sorted_ids.shape == (max_num_tokens_padded(pairs, E, block_size),)
    assert expert_ids.shape == (max_num_m_blocks(pairs, E, block_size),)
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=E)
    padded = -(-counts // block_size) * block_size
    total = int(num_post)
    assert total == int(padded.sum()) and total % block_size == 0
    assert total <= expert_ids.numel() * block_size
    real = sorted_ids[:total]
    assert torch.equal(torch.sort(real[real < pairs]).values, torch.arange(pairs, dtype=torch.int32))
    assert bool((sorted_ids[total:] == pairs).all()) and bool((expert_ids[total // block_size:] == -1).all())
    start = 0
    for e in range(E):   # each expert's group: its pairs in token order, then sentinels up to a block edge
        group = sorted_ids[start:start + int(padded[e])]
        n = int(counts[e])
        assert torch.equal(group[:n], torch.nonzero(flat == e).reshape(-1).to(torch.int32))
        assert bool((group[n:] == pairs).all())
        assert bool((expert_ids[start // block_size:(start + int(padded[e])) // block_size] == e).all())
        start += int(padded[e])
    if kind == "skip":
        assert counts[1] == 0 and not bool((expert_ids == 1).any())


def test_align_refuses_bad_sizes() -> None:
    ids = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_size"):
        moe_align_block_size(ids, 0, 4)
    with pytest.raises(ValueError, match="num_experts"):
        moe_align_block_size(ids, 16, 0)


def dense_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every token in float32 products, rounded to x's dtype where a model's
    torch MLP rounds (gate_up, silu, silu * up), then each token's k routed outputs weighted and
    summed in float32."""
    dt, inter = x.dtype, w2.shape[2]
    gate_up = torch.einsum("th,enh->ten", x.float(), w13.float()).to(dt)          # [T, E, 2I]
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    out = torch.einsum("tei,ehi->teh", act.float(), w2.float())                    # [T, E, H]
    routed = out.gather(1, ids.long()[..., None].expand(-1, -1, out.shape[-1]))   # [T, k, H]
    return (routed * weights[..., None]).sum(1).to(dt)


def interpreted_dots() -> AbstractContextManager[None]:
    """Under the interpreter, bfloat16 dots made exact (`triton_bf16_dot`); compiled, nothing."""
    return nullcontext() if HAS_CUDA else exact_bf16_dots()


def run_fused(*args: torch.Tensor) -> torch.Tensor:
    with interpreted_dots():
        return fused_experts(*args)


# (routing, T, E, k, H, I): the edge routings at tiny sizes (H, I not multiples of the tiles), a
# decode step, and T large enough for the "medium" and "large" launch entries
MOE_CASES = [("skip", 20, 8, 2, 64, 32), ("one", 11, 4, 1, 48, 40), ("one", 6, 5, 3, 32, 64),
             ("all", 7, 4, 4, 64, 32), ("skip", 1, 8, 3, 32, 32), ("random", 40, 4, 2, 32, 32),
             ("random", 140, 4, 2, 32, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,T,E,k,H,I", MOE_CASES)
def test_fused_experts_matches_dense_reference(kind: str, T: int, E: int, k: int, H: int, I: int,  # noqa: E741
                                               dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(T * 1000 + E * 100 + k * 10 + H)
    weights, ids = routing(kind, T, E, k, g)
    wide = torch.randn(T, H + 8, generator=g)
    x = wide.to(DEVICE, dtype)[:, 8:]   # rows of a wider tensor: read through their stride
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(DEVICE, dtype)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    got = run_fused(x, w13, w2, weights, ids)
    ref = dense_reference(x, w13, w2, weights, ids)
    ok, err, bound = compare(got, ref, dtype)
    assert ok, f"{regime(T, k, E)}: max error {err:.3g} > {bound:.3g}"
    # the routing matters: another expert for one pair changes the result beyond the tolerance
    moved = ids.clone()
    moved[0, 0] = (moved[0, 0] + 1) % E
    assert not compare(dense_reference(x, w13, w2, weights, moved), ref, dtype)[0]


def test_fused_experts_covers_every_regime() -> None:
    assert {regime(T, k, E) for _, T, E, k, _, _ in MOE_CASES} == {"small", "medium", "large"}


def test_fused_experts_no_tokens_and_bad_inputs() -> None:
    x, w13, w2 = torch.randn(0, 32), torch.randn(4, 64, 32), torch.randn(4, 32, 32)
    weights, ids = torch.rand(0, 2), torch.zeros(0, 2, dtype=torch.int32)
    assert fused_experts(x, w13, w2, weights, ids).shape == (0, 32)
    x, weights, ids = torch.randn(3, 32), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int32)
    bad: list[tuple[str, tuple[Any, ...]]] = [
        ("x must be", (x.double(), w13, w2, weights, ids)),
        ("w13 must be", (x, torch.randn(4, 63, 32), w2, weights, ids)),
        ("w2 must be", (x, w13, torch.randn(4, 32, 16), weights, ids)),
        ("in x's dtype", (x, w13.half(), w2, weights, ids)),
        ("topk_ids must be", (x, w13, w2, weights, ids.float())),
        ("topk_weights must be", (x, w13, w2, weights.half(), ids)),
        ("topk_weights must be", (x, w13, w2, weights[:, :1], ids)),
    ]
    for match, args in bad:
        with pytest.raises(ValueError, match=match):
            fused_experts(*args)


def test_launch_table() -> None:
    """Every entry fits tl.dot (powers of two >= 16); regimes by mean pairs per expert; the dtype class."""
    for entry in TABLE.values():
        sizes = (entry.block_size_m, entry.block_size_n, entry.block_size_k)
        assert all(n >= 16 and n & (n - 1) == 0 for n in sizes), entry
    assert {r for r, _ in TABLE} == {"small", "medium", "large"} and {c for _, c in TABLE} == {"half", "float32"}
    assert regime(8, 2, 1) == "small" and regime(1, 8, 128) == "small" and regime(9, 2, 1) == "medium"
    assert regime(32, 2, 1) == "medium" and regime(33, 2, 1) == "large"
    assert launch_for(1, 8, 128, torch.bfloat16) == launch_for(1, 8, 128, torch.float16) == TABLE["small", "half"]
    assert launch_for(4096, 8, 128, torch.float32) == TABLE["large", "float32"]


class _MoEModel(nn.Module):
    """A sparse block's experts named by role, as the core's MoE models do."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def replaceable_modules(self) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
        yield "moe", self, "experts", self.experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fused_moe_is_the_moe_override(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cuda_op_overrides` replaces the "moe" role by TritonFusedMoE, which keeps the reference's
    attributes and parameters and matches it on the role's cases (`moe_cases`: an expert with no
    token, every token to every expert, softmax and sigmoid routers, renormalised or not)."""
    monkeypatch.delenv("POLYRUNNER_CUDA_FUSED", raising=False)
    monkeypatch.delenv("POLYRUNNER_CUDA_TRITON", raising=False)
    overrides = cuda_op_overrides(EngineConfig(model=ModelConfig()), dtype)
    compared = 0
    sizes = CaseSizes(rows=(1, 13), hidden=(64, 40), intermediate=(32, 48))
    for case in moe_cases(dtype, DEVICE, sizes, torch.Generator().manual_seed(7)):
        model = _MoEModel(case.module)
        assert apply_overrides(model, overrides)["moe"] == 1
        fused = model.experts
        assert isinstance(fused, TritonFusedMoE)
        assert fused.w13_weight is case.module.w13_weight and fused.w2_weight is case.module.w2_weight
        for attr in ("num_experts", "top_k", "intermediate", "renormalize", "scoring"):
            assert getattr(fused, attr) == getattr(case.module, attr), attr
        for call in case.calls:
            with interpreted_dots():
                got = call.run(fused)
            for g, r in zip(got, call.run(case.module), strict=True):
                ok, err, bound = compare(g, r, dtype)
                assert ok, f"{call.shape} top_k={fused.top_k}: max error {err:.3g} > {bound:.3g}"
                compared += 1
    assert compared == 2 * 2 * 2   # 2 sizes x 2 router settings x 2 row counts


# --- compiled for sm_90 (a subprocess without the interpreter; tests/test_triton_compile.py's ptxas helper)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (launch key, dtype, MUL_ROUTED_WEIGHT, top_k): gate_up launches gather rows (top_k > 1), down
# launches scale by the routing weight (top_k = 1); every table entry in one of its dtypes
COMPILE_CASES = [(key, dt, mul, 1 if mul else 8) for key in TABLE for mul in (False, True)
                 for dt in (("fp32",) if key[1] == "float32" else ("bf16",))] + [(("small", "half"), "fp16", True, 1)]
VARIANTS = [f"fused_moe {r} {dt} mul={mul} top_k={tk}" for (r, _), dt, mul, tk in COMPILE_CASES]


def compile_all(arch: int) -> dict[str, dict[str, int]]:
    """Compile every COMPILE_CASES variant of `fused_moe_kernel` for `cuda:arch`: name -> ptxas usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from polyrunner.backends.cuda.triton_moe import fused_moe_kernel
    from test_triton_compile import ptxas_usage

    fn = fused_moe_kernel
    ptr = {"a_ptr": "*{dt}", "b_ptr": "*{dt}", "c_ptr": "*{dt}", "topk_weights_ptr": "*fp32",
           "sorted_token_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_tokens_post_padded_ptr": "*i32"}
    # what a launch on contiguous tensors specialises: unit inner strides, 16-divisible pointers and sizes
    divisible = (*ptr, "N", "K", "EM", "stride_am", "stride_be", "stride_bn", "stride_cm")
    done: dict[str, dict[str, int]] = {}
    for (key, dt, mul, top_k), name in zip(COMPILE_CASES, VARIANTS):
        launch: MoELaunch = TABLE[key]
        consts = dict(BLOCK_SIZE_M=launch.block_size_m, BLOCK_SIZE_N=launch.block_size_n,
                      BLOCK_SIZE_K=launch.block_size_k, GROUP_SIZE_M=launch.group_size_m, MUL_ROUTED_WEIGHT=mul,
                      top_k=top_k, IEEE=dt == "fp32", stride_ak=1, stride_bk=1, stride_cn=1)
        sig = {n: "constexpr" if n in consts else ptr.get(n, "i32").format(dt=dt) for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()},
                        attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible})
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
        done[name] = {**ptxas_usage(kernel.asm["ptx"], arch), "cubin": len(kernel.asm["cubin"]),
                      "shared": kernel.metadata.shared}
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


def test_every_table_entry_is_compiled() -> None:
    assert {key for key, *_ in COMPILE_CASES} == set(TABLE)


def test_kernel_compiles_for_sm90_without_spills(compiled: dict[str, dict[str, int]]) -> None:
    from test_triton_compile import SM90_SHARED

    assert sorted(compiled) == sorted(VARIANTS)
    for name, report in compiled.items():
        assert report["cubin"] > 0 and report["regs"] > 0, (name, report)
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, f"{name} spills registers: {report}"
        assert report["shared"] <= SM90_SHARED, f"{name} needs more shared memory than sm_90 has: {report}"


if __name__ == "__main__":
    print(json.dumps(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
