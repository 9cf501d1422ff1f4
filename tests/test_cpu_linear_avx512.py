"""The AVX-512F bfloat16 linear (`linear_avx512.cpp`, kernel "avx512" of `kernel_table.py`): for
CPUs with AVX-512F but no AVX512_BF16 (Ice Lake, Skylake-SP), where it is the only pool kernel.

- The kernel against the float64 product: bfloat16 and float32 activations, decode and prefill
  row counts, odd N and K (zero-padded in the packed copy), strided rows, one thread and the pool.
- Its clean absence in the portable build (`POLYRUNNER_CPU_SIMD=0`).
- Forced through the selection (`POLYRUNNER_CPU_LINEAR=avx512`): the embedded SmolLM2's bfloat16
  decode steps are captured as CPU graphs that call it, and give the eager steps' tokens and
  logprobs exactly. (The whole tiny model against the reference model on this kernel:
  test_cpu_fast_paths.py's [avx512] path; forced vs measured on one linear: test_cpu_kernel_table.py.)
"""

from __future__ import annotations

import pytest
import torch

from polyrunner.backends.cpu import kernel_table, kernels
from tolerances import assert_linear_close

lib = kernels.paged_attention_kernel()
_native = kernels.load_library("native") if lib is not None else None
needs_avx512 = pytest.mark.skipif(_native is None or _native.pr_avx512_available() != 1,
                                  reason="no AVX-512F kernel build here (no C++ compiler, or the CPU lacks AVX512F)")


@pytest.fixture
def native(monkeypatch):
    monkeypatch.delenv("POLYRUNNER_CPU_AVX512", raising=False)
    with kernels.use_kernels("native"):
        yield


@needs_avx512
@pytest.mark.parametrize("shape", [(96, 128), (37, 51), (1000, 77), (16, 1)])   # (N, K); 1000 x 77: threaded
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_exact_product(native, shape, dtype, threads):
    N, K = shape
    kernels.start_pool(threads)
    g = torch.Generator().manual_seed(N + K)
    w = (torch.randn(N, K, generator=g) / 8).to(torch.bfloat16)
    packed = kernels.avx512_pack_bf16(w)
    assert packed.numel() == (N + 15) // 16 * 16 * ((K + 1) // 2 * 2)
    for M in (1, 3, 16, 64, 200):
        x = torch.randn(M, K + 5, generator=g)[:, 2:K + 2].to(dtype)   # rows strided, unit column stride
        y = kernels.avx512_linear_bf16(x, packed, N)
        assert y is not None and y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert_linear_close(y, x, w, msg=f"{dtype} x, {M} rows, {N} x {K}, {threads} threads: ")


@needs_avx512
def test_kernel_declines_what_it_does_not_take(native):
    w = torch.randn(32, 16).to(torch.bfloat16)
    packed = kernels.avx512_pack_bf16(w)
    assert kernels.avx512_linear_bf16(torch.randn(4, 32)[:, ::2], packed, 32) is None            # column stride 2
    assert kernels.avx512_linear_bf16(torch.randn(4, 16, dtype=torch.float64), packed, 32) is None   # float64


@pytest.mark.skipif(lib is None, reason="no CPU kernel library (no C++ compiler?)")
def test_absent_from_the_portable_build_and_when_turned_off(monkeypatch):
    with kernels.use_kernels("portable") as portable:
        if portable is None:
            pytest.skip("the portable kernel build failed")
        assert portable.pr_avx512_available() == 0
        assert "portable" in kernels.avx512_unavailable_reason()
        assert "avx512" not in kernel_table.available()
    monkeypatch.setenv("POLYRUNNER_CPU_AVX512", "0")
    with kernels.use_kernels("native") if _native is not None else kernels.use_kernels("portable"):
        assert kernels.avx512_unavailable_reason() == "POLYRUNNER_CPU_AVX512=0"
        assert "avx512" not in kernel_table.available()
        monkeypatch.setenv("POLYRUNNER_CPU_LINEAR", "avx512")
        with pytest.raises(ValueError, match="POLYRUNNER_CPU_LINEAR=avx512: that kernel cannot run here"):
            kernel_table.forced()


def test_plan_prefers_it_over_onednn_for_pool_steps():
    """Up to `POOL_STEP_ROWS` rows a pool kernel runs (graph-replayable); above, the faster."""
    times = {"avx512": {1: 50.0, 64: 500.0, 256: 4000.0}, "onednn": {1: 40.0, 64: 900.0, 256: 3000.0}}
    plan = kernel_table.plan(times, 256, ["avx512", "onednn"])
    assert set(plan[:65]) == {"avx512"} and plan[256] == "onednn"
    assert plan[118] == "avx512" and plan[119] == "onednn"   # the interpolated times cross at 118.9 rows
    assert kernel_table.pool_prefix(plan) == 118


def _greedy(llm, prompts, n: int = 24):
    from polyrunner import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.skipif(lib is None or lib.pr_avx512_available() != 1,
                    reason="the backend's kernel build has no AVX-512F linear (POLYRUNNER_CPU_SIMD=0, or no AVX512F)")
def test_bfloat16_decode_steps_replay_as_cpu_graphs(monkeypatch):
    """With every linear on this kernel, a bfloat16 decode step is all replayable C++ kernels: it is
    captured (its records call the kernel) and replays the eager steps' tokens and logprobs."""
    from polyrunner import LLM
    from polyrunner.backends.cpu.kernel_calls import KERNEL_IDS
    from polyrunner.backends.cpu.packed_linear import PackedLinear
    monkeypatch.setenv("POLYRUNNER_CPU_LINEAR", "avx512")
    monkeypatch.delenv("POLYRUNNER_CPU_AVX512", raising=False)
    kw = dict(backend="cpu", dtype="bfloat16", max_model_len=256, max_num_seqs=4, block_size=16,
              kv_cache_memory_bytes=16 << 20)
    graphs, eager = LLM(**kw), LLM(enforce_eager=True, **kw)
    ex = graphs.engine.runner.executor
    packed = [m for m in ex.model.modules() if isinstance(m, PackedLinear)] + [ex.packed_logits]
    assert packed and all(set(m.plan) == {"avx512"} for m in packed)
    assert ex.graph_rows == 4 and ex.num_graphs() > 0
    prompts = [[3 + (7 * i + 11 * j) % 900 for j in range(5 + 9 * i)] for i in range(3)]
    assert _greedy(graphs, prompts) == _greedy(eager, prompts)
    assert ex.counters()["replays"] > 20
    for size, graph in ex.graphs.items():   # each decode graph calls the kernel (its records: graphs.py)
        assert KERNEL_IDS["pr_avx512_linear_bf16"] in set(graph.replay.records[:, 0].tolist()), size
