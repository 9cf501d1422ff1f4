"""The CPU backend's "moe" override (backends/cpu/moe_module.py, moe_experts.cpp): one C++ call per
MoE layer, against the core's `FusedMoE` within the role's tolerance.

- the role's random cases and edge routings (an expert without tokens, top_k == E, T = 0, 1, 300,
  several kernel passes), float32 and bfloat16, renormalised or not, softmax or sigmoid, on the
  native build (AVX-512F where the CPU has it) and the portable one (plain loops);
- the factory keeps what the kernel does not take; the override is registered for bfloat16 only;
- a CPU graph records the call and its replay recomputes from the inputs' current values;
- a tiny Mixtral's greedy tokens with the override equal those without it (float32), and the
  engine's decode steps replay as CPU graphs where the CPU has the pool's bfloat16 linears.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.moe_module import CPUFusedMoE, MoEOverride, chunk_tokens
from polyrunner.ops import FusedMoE, apply_overrides
from polyrunner.ops.cases import CaseSizes, compare, moe_cases
from polyrunner.ops.roles import ROLES

pytestmark = pytest.mark.skipif(kernels.paged_attention_kernel() is None,
                                reason="no CPU kernel library (no C++ compiler?)")


def _avx512f() -> bool:
    try:
        return any(line.startswith("flags") and " avx512f " in f"{line} " for line in open("/proc/cpuinfo"))
    except OSError:
        return False


@pytest.fixture(params=["native", "portable"])
def moe_lib(request):
    """Each kernel build: native (the AVX-512F path where the CPU has AVX-512F) and portable."""
    lib = kernels.load_library(request.param)
    assert lib is not None
    assert lib.pr_moe_simd() == (request.param == "native" and _avx512f())
    with kernels.use_kernels(request.param) as active:
        yield active


def _moe(experts: int, top_k: int, hidden: int, inter: int, renormalize: bool = True, scoring: str = "softmax",
         dtype: torch.dtype = torch.float32, seed: int = 0) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    moe = FusedMoE(experts, top_k, hidden, inter, renormalize, scoring)
    moe.w13_weight.data = torch.randn(moe.w13_weight.shape, generator=gen) * hidden ** -0.5
    moe.w2_weight.data = torch.randn(moe.w2_weight.shape, generator=gen) * inter ** -0.5
    return moe.to(dtype)


def _inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, seed: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=gen).to(dtype),
            (torch.randn(tokens, experts, generator=gen) * 2).to(dtype))


def _check(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    ok, err, bound = compare(got, ref, dtype)
    assert ok, f"max abs error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_roles_random_cases(moe_lib, dtype):
    sizes = CaseSizes(rows=(1, 7, 37), hidden=(64, 72, 100), intermediate=(128, 100, 36))
    cases = list(moe_cases(dtype, torch.device("cpu"), sizes, torch.Generator().manual_seed(0)))
    assert len(cases) == 6
    for case in cases:
        override = MoEOverride(64)(case.module)
        assert isinstance(override, CPUFusedMoE)
        for call in case.calls:
            (ref,), (got,) = call.run(case.module), call.run(override)
            _check(got, ref, dtype)


EDGES = {   # experts, top_k, hidden, intermediate, tokens, renormalize, scoring
    "t1": (8, 2, 64, 32, 1, True, "softmax"),
    "t0": (8, 2, 64, 32, 0, True, "softmax"),
    "t300": (32, 4, 96, 48, 300, True, "softmax"),
    "top_k_is_E": (4, 4, 40, 24, 9, False, "sigmoid"),
    "sigmoid_renormalised": (6, 3, 48, 20, 17, True, "sigmoid"),
    "softmax_not_renormalised": (6, 1, 48, 20, 17, False, "softmax"),
    "odd_sizes": (5, 2, 33, 7, 11, True, "softmax"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("edge", list(EDGES))
def test_edge_routings(moe_lib, edge, dtype):
    experts, top_k, hidden, inter, tokens, renormalize, scoring = EDGES[edge]
    moe = _moe(experts, top_k, hidden, inter, renormalize, scoring, dtype)
    x, logits = _inputs(tokens, hidden, experts, dtype)
    override = MoEOverride(512)(moe)
    got = override(x, logits)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    _check(got, moe(x, logits), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_expert_without_tokens_and_float32_logits_over_several_passes(moe_lib, dtype):
    """Expert 2 is never chosen; router logits in float32 with bfloat16 x; 50 tokens in passes of 7."""
    moe = _moe(8, 2, 64, 32, dtype=dtype)
    x, logits = _inputs(50, 64, 8, torch.float32)
    logits[:, 2] = -30.0
    override = MoEOverride(7)(moe)
    assert isinstance(override, CPUFusedMoE) and override.chunk == 7
    _check(override(x.to(dtype), logits), moe(x.to(dtype), logits), dtype)


def test_the_override_keeps_the_roles_attributes_and_parameters():
    moe = _moe(4, 2, 32, 16, False, "sigmoid", torch.bfloat16)
    override = MoEOverride(16)(moe)
    assert isinstance(override, CPUFusedMoE)
    for name in ("num_experts", "top_k", "intermediate", "renormalize", "scoring"):
        assert getattr(override, name) == getattr(moe, name)
    assert override.w13_weight is moe.w13_weight and override.w2_weight is moe.w2_weight
    assert {n for n, _ in override.named_parameters()} == {"w13_weight", "w2_weight"}


def test_the_factory_keeps_what_the_kernel_does_not_take():
    factory = MoEOverride(16)
    half = _moe(4, 2, 32, 16, dtype=torch.float16)
    assert factory(half) is half
    strided = _moe(4, 2, 32, 16)
    strided.w13_weight.data = strided.w13_weight.data.transpose(1, 2).contiguous().transpose(1, 2)
    assert factory(strided) is strided
    other = torch.nn.Linear(4, 4)
    assert factory(other) is other
    with pytest.raises(ValueError, match="max_tokens"):
        MoEOverride(0)


def test_inputs_the_kernel_does_not_take_run_the_reference():
    moe = _moe(4, 2, 32, 16, dtype=torch.bfloat16)
    override = MoEOverride(16)(moe)
    x, logits = _inputs(5, 32, 4, torch.bfloat16)
    half = logits.to(torch.float16)
    assert torch.equal(override(x, half), moe(x, half))      # float16 router logits
    wide = torch.randn(5, 64).to(torch.bfloat16)[:, ::2]       # x with a stride along the row
    assert torch.equal(override(wide, logits), moe(wide, logits))


def test_layers_of_one_shape_share_one_scratch_sized_once():
    factory = MoEOverride(2048)
    a, b = factory(_moe(8, 2, 64, 32)), factory(_moe(8, 2, 64, 32, seed=3))
    assert isinstance(a, CPUFusedMoE) and isinstance(b, CPUFusedMoE)
    assert a.scratch.data_ptr() == b.scratch.data_ptr() and a.chunk == chunk_tokens(64, 32, 2, 2048) == 2048
    assert chunk_tokens(4096, 14336, 2, 8192) < 8192   # a big model's passes stay within the budget
    with pytest.raises(RuntimeError, match="code 1"):   # pr_moe refuses what it cannot hold (top_k > E)
        a.top_k = 9
        a(*_inputs(2, 64, 8, torch.float32))


def test_registered_for_bfloat16_only_and_switched_off_by_env(monkeypatch):
    from types import SimpleNamespace

    from polyrunner.backends.cpu.op_overrides import cpu_op_overrides
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=8),
                             runner=SimpleNamespace(enforce_eager=True, token_buckets=None),
                             parallel=SimpleNamespace(tensor_parallel_size=1))
    factory = cpu_op_overrides(config, torch.bfloat16)["moe"]
    assert isinstance(factory, MoEOverride) and factory.max_tokens == 256
    assert "moe" not in cpu_op_overrides(config, torch.float32)
    monkeypatch.setenv("POLYRUNNER_CPU_MOE", "0")
    assert "moe" not in cpu_op_overrides(config, torch.bfloat16)
    assert ROLES["moe"].reference is FusedMoE


def test_a_cpu_graph_records_the_call_and_replays_it():
    from polyrunner.backends.cpu.graphs import CPUGraphAPI
    lib = kernels.paged_attention_kernel()
    api = CPUGraphAPI(lib)
    moe = _moe(8, 2, 64, 32, dtype=torch.bfloat16)
    override = MoEOverride(16)(moe)
    x, logits = _inputs(3, 64, 8, torch.bfloat16)
    replay, out = api.capture(lambda: override(x, logits), api.pool())
    for seed in (5, 6):
        new_x, new_logits = _inputs(3, 64, 8, torch.bfloat16, seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        replay()
        assert torch.equal(out, override(x, logits))


def _tiny_mixtral(tmp_path: Path) -> Path:
    from moe_tiny_models import build_moe_model
    build_moe_model("mixtral", tmp_path)
    return tmp_path


PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 44], [17] * 12]


def _greedy(llm, n: int = 8) -> list[list[int]]:
    from polyrunner import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_a_tiny_mixtrals_greedy_tokens_with_the_override_equal_the_reference(tmp_path, moe_lib):
    """float32 (where the backend keeps the reference): the override applied to every layer by hand."""
    from polyrunner import LLM
    llm = LLM(str(_tiny_mixtral(tmp_path)), backend="cpu", dtype="float32", max_num_seqs=4,
              kv_cache_memory_bytes=16 << 20, enforce_eager=True)
    model = llm.engine.runner.model
    assert all(type(m) is FusedMoE for m in model.modules() if isinstance(m, FusedMoE))
    want = _greedy(llm)
    replaced = apply_overrides(model, {"moe": MoEOverride(64)})
    assert replaced == {"moe": 2} and all(isinstance(layer.mlp.experts, CPUFusedMoE) for layer in model.layers)
    assert _greedy(llm) == want


def test_a_bfloat16_mixtrals_decode_steps_replay_as_cpu_graphs(tmp_path):
    """Graphs need every linear on the pool's kernels (AVX512_BF16 or AMX for bfloat16 weights)."""
    from polyrunner import LLM
    if not (kernels.dpbf16_available() or kernels.amx_available() or kernels.avx512_available()):
        pytest.skip("this CPU has no AVX-512 (nor AMX): bfloat16 linears run in oneDNN, no CPU graphs")
    folder = _tiny_mixtral(tmp_path)
    common = dict(backend="cpu", dtype="bfloat16", max_num_seqs=4, kv_cache_memory_bytes=16 << 20)
    graphs, eager = LLM(str(folder), **common), LLM(str(folder), enforce_eager=True, **common)
    assert isinstance(graphs.engine.runner.model.layers[0].mlp.experts, CPUFusedMoE)
    assert graphs.engine.runner.executor.num_graphs() > 0
    assert _greedy(graphs) == _greedy(eager)
    assert graphs.engine.runner.executor.counters()["replays"] > 0
