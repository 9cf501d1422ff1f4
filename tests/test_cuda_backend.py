"""The CUDA backend plugin.

On a CPU-only machine this checks the probe, the bucket policy, the SDPA
paged-attention fast path against `reference_paged_attention`, and the
static-buffer graph executor end to end through the engine with a simulated
graph API (`SimGraphAPI`: a capture records the ops, a replay re-executes the record
on the static buffers, under the core's capture guard).
Tests marked `needs_cuda` run the same checks with real CUDA graphs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from polyrunner.attention.batched import STATIC_DECODE, paged_decode, sdpa_paged_attention
from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import reference_paged_attention
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.backends.cuda.plugin import CUDABackend
from polyrunner.config import EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from polyrunner.device.graphs import GraphBucketPolicy, StaticGraphExecutor, graph_bucket_policy
from polyrunner.device.tape_graph import TapeGraph, TapeGraphAPI, Task
from polyrunner.plugins import hookimpl, list_backends, register
from polyrunner.plugins.manager import unregister
from polyrunner.tools.conformance.tiny_llama import write_tiny_llama as conformance_tiny_llama
from tolerances import assert_close_ulp, assert_detects_errors, attention_reference

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")


# ---- helpers -----------------------------------------------------------------
def write_tiny_llama(folder):
    """The conformance suite's random Llama, 512 tokens of vocabulary and context."""
    return conformance_tiny_llama(folder, vocab_size=512, max_position_embeddings=512)


def make_batch(reqs, *, block_size, num_blocks, max_blocks, T_pad=None, R_pad=None, seed=0, device="cpu"):
    """Metadata for requests `(context_len, num_new)` (decode-first), each on its own random blocks."""
    rng = np.random.default_rng(seed)
    R = len(reqs)
    T = sum(n for _, n in reqs)
    T_pad, R_pad = T_pad or T, R_pad or R
    perm = rng.permutation(np.arange(1, num_blocks))  # block 0 is the null block
    tables = np.zeros((R_pad, max_blocks), np.int32)
    slots, positions, t2r = np.zeros(T_pad, np.int64), np.zeros(T_pad, np.int64), np.zeros(T_pad, np.int32)
    qsl, seq_lens = np.full(R_pad + 1, T, np.int32), np.zeros(R_pad, np.int32)
    qsl[0], used, t = 0, 0, 0
    for r, (ctx, n) in enumerate(reqs):
        nb = -(-(ctx + n) // block_size)
        tables[r, :nb] = perm[used:used + nb]
        used += nb
        pos = np.arange(ctx, ctx + n)
        positions[t:t + n], t2r[t:t + n] = pos, r
        slots[t:t + n] = tables[r, pos // block_size].astype(np.int64) * block_size + pos % block_size
        t += n
        qsl[r + 1], seq_lens[r] = t, ctx + n
    dev = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    num_decodes = next((i for i, (_, n) in enumerate(reqs) if n != 1), R)
    return AttentionMetadata(
        num_actual_tokens=T, num_reqs=R, num_decodes=num_decodes,
        max_query_len=max(n for _, n in reqs), max_seq_len=int(seq_lens.max()),
        query_start_loc=dev(qsl), seq_lens=dev(seq_lens), block_tables=dev(tables),
        slot_mapping=dev(slots), positions=dev(positions), token_to_req=dev(t2r),
        query_start_loc_np=qsl, seq_lens_np=seq_lens)


def _qkv(T, spec, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, spec.num_heads, spec.head_size, generator=g)
    k = torch.randn(T, spec.num_kv_heads, spec.head_size, generator=g)
    v = torch.randn(T, spec.num_kv_heads, spec.head_size, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def _config(**sched):
    return EngineConfig(model=ModelConfig(), scheduler=SchedulerConfig(**sched))


# ---- probe and registration ------------------------------------------------
@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is present")
def test_probe_unavailable_with_reason():
    av = CUDABackend.probe()
    assert not av.available and av.reason
    assert "CUDA" in av.reason


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is present")
def test_list_backends_marks_cuda_and_npu_unavailable():
    infos = {i.name: i for i in list_backends()}
    for name in ("cuda", "npu"):
        assert not infos[name].availability.available and infos[name].availability.reason
    assert infos["cuda"].graph_mode == "cuda_graph" and infos["npu"].graph_mode == "acl_graph"
    assert infos["cpu"].availability.available


def test_capabilities():
    caps = CUDABackend.capabilities
    assert caps.counts_graphs and caps.graph_mode == "cuda_graph" and not caps.static_shapes


# ---- buckets -------------------------------------------------------------------
@pytest.mark.parametrize("seqs,tokens", [(64, 2048), (256, 8192), (1024, 4096), (48, 40), (1, 16)])
def test_bucket_policy(seqs, tokens):
    policy = graph_bucket_policy(_config(max_num_seqs=seqs, max_num_batched_tokens=tokens))
    top = min(seqs, 512, tokens)
    for buckets in (policy.token_buckets, policy.request_buckets):
        assert buckets == sorted(set(buckets)) and buckets[-1] == top
        assert buckets[:3] == [1, 2, 4][: len(buckets[:3])] or top < 4
        assert all(b % 8 == 0 for b in buckets if 4 < b < 256) and all(b % 16 == 0 for b in buckets if b >= 256)
    prev = (0, 0)
    for n in range(1, tokens + 1):  # every size is covered, padding is monotonic and bounded
        t, r = policy.pad(n, min(n, seqs))
        assert t >= n and r >= min(n, seqs) and (t, r) >= prev
        assert t - n <= policy.max_padding(n)
        if n <= top:
            assert t in policy.token_buckets
        else:
            assert t == n  # above the largest graph: unpadded, eager
        prev = (t, r)


def test_bucket_policy_eager_and_overrides():
    eager = graph_bucket_policy(EngineConfig(model=ModelConfig(), runner=RunnerConfig(enforce_eager=True)))
    assert eager.token_buckets == [] and eager.pad(5, 3) == (5, 3)
    cfg = EngineConfig(model=ModelConfig(), runner=RunnerConfig(token_buckets=[8, 1, 4], request_buckets=[4, 8]))
    policy = graph_bucket_policy(cfg)
    assert isinstance(policy, GraphBucketPolicy)
    assert policy.token_buckets == [1, 4, 8] and policy.pad(3, 3) == (4, 4) and policy.pad(9, 9) == (9, 9)


# ---- attention fast path ------------------------------------------------------------
BATCHES = {
    "decode_only": [(5, 1), (40, 1), (0, 1), (17, 1)],
    "prefill_only": [(0, 7), (0, 33), (0, 1 + 15)],
    "mixed": [(3, 1), (64, 1), (0, 12), (20, 9), (31, 1 + 2)],  # fresh, cached-context prefills
    "long_decode": [(150, 1), (99, 1), (1, 1)],
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (8, 1, None), (4, 4, None), (4, 2, 24)])
@pytest.mark.parametrize("workspace", [None, 1])  # 1 byte: one block per decode chunk
def test_fast_path_matches_reference(batch, heads, kv_heads, window, workspace, monkeypatch):
    if workspace is not None:
        monkeypatch.setattr(paged_decode, "__defaults__", (workspace,))
    bs, nb, D = 16, 64, 32
    reqs = BATCHES[batch]
    T = sum(n for _, n in reqs)
    meta = make_batch(reqs, block_size=bs, num_blocks=nb, max_blocks=12, T_pad=T + 5, R_pad=len(reqs) + 3, seed=1)
    spec = LayerSpec(heads, kv_heads, D, D ** -0.5, window)
    q, k, v = _qkv(T + 5, spec, seed=2)
    cache = torch.randn(2, nb, bs, kv_heads, D, generator=torch.Generator().manual_seed(3))
    poison_unused_slots(cache, meta, bs)
    ref_cache, fast_cache = cache.clone(), cache.clone()
    reference_paged_attention(q, k, v, ref_cache, meta, spec)   # the cache writes
    expected, bound = attention_reference(q, k, v, cache, meta, spec)   # float64, and fp32 math's bound
    fast = sdpa_paged_attention(q, k, v, fast_cache, meta, spec)
    assert_detects_errors(lambda out: assert_close_ulp(out, expected[:T], ulps=1, abs_err=bound[:T]), fast[:T])
    assert torch.equal(fast_cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))
    assert torch.isfinite(fast).all()


def poison_unused_slots(cache, meta, bs):
    """NaN in every slot outside the requests' contexts except the null block: a
    backend may leave unwritten KV memory uninitialised (the CPU backend does)."""
    keep = torch.zeros(cache.shape[1] * bs, dtype=torch.bool)
    keep[:bs] = True
    for r in range(meta.num_reqs):
        pos = torch.arange(int(meta.seq_lens_np[r]))
        keep[meta.block_tables[r, pos // bs].long() * bs + pos % bs] = True
    cache.view(2, -1, *cache.shape[3:])[:, ~keep] = float("nan")


def test_static_decode_equals_reference_and_pads_finite():
    bs, nb, D = 8, 40, 16
    spec = LayerSpec(4, 2, D, D ** -0.5)
    reqs = [(3, 1), (30, 1), (0, 1)]
    meta = make_batch(reqs, block_size=bs, num_blocks=nb, max_blocks=6, T_pad=8, R_pad=8, seed=4)
    q, k, v = _qkv(8, spec, seed=5)
    cache = torch.randn(2, nb, bs, 2, D, generator=torch.Generator().manual_seed(6))
    poison_unused_slots(cache, meta, bs)
    expected, bound = attention_reference(q, k, v, cache, meta, spec)
    meta.extras[STATIC_DECODE] = True
    meta.query_start_loc_np = meta.seq_lens_np = None  # the static path must not read host metadata
    static = sdpa_paged_attention(q, k, v, cache.clone(), meta, spec)
    assert_detects_errors(lambda out: assert_close_ulp(out, expected[:3], ulps=1, abs_err=bound[:3]), static[:3])
    assert torch.isfinite(static).all()  # padded rows (seq_len 0) attend to the null slot


def test_fast_path_low_precision_close_to_reference():
    bs, nb, D = 16, 32, 64
    spec = LayerSpec(8, 2, D, D ** -0.5)
    reqs = [(10, 1), (50, 1), (0, 20), (16, 4)]
    meta = make_batch(reqs, block_size=bs, num_blocks=nb, max_blocks=8, seed=7)
    q, k, v = _qkv(26, spec, seed=8, dtype=torch.bfloat16)
    cache = torch.randn(2, nb, bs, 2, D, generator=torch.Generator().manual_seed(9)).bfloat16()
    # float64 of the same bfloat16 inputs; fp32 math with P rounded to bfloat16 for P.V (flash attention)
    expected, bound = attention_reference(q, k, v, cache, meta, spec, p_dtype=torch.bfloat16)
    fast = sdpa_paged_attention(q, k, v, cache.clone(), meta, spec)
    assert fast.dtype == torch.bfloat16
    assert_detects_errors(lambda out: assert_close_ulp(out, expected, ulps=1, abs_err=bound), fast, rel=0.02)


# ---- the graph executor through the engine (simulated graphs on CPU) ---------------
class SimGraphAPI(TapeGraphAPI):
    """CPU stand-in for CUDA graphs: a capture records the step's ops, a replay re-executes
    the record on the static buffers (`TapeGraph`), never the Python; every capture runs under
    the core's capture guard, so a host sync fails here as on the device. A Triton kernel
    launched under Triton's interpreter is recorded as one task (`_record_triton_launches`),
    as a CUDA graph records a kernel. `fail`: every capture fails as an out-of-memory or an
    unsupported op would."""

    name = "sim graphs"

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail

    def capture(self, fn, pool):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing (simulated)")
        with _record_triton_launches():
            return super().capture(fn, pool)


@contextlib.contextmanager
def _record_triton_launches():
    """While a `TapeGraph` captures: each launch of an interpreted Triton kernel runs once with
    every dispatch mode off (the interpreter's host copies are not the kernel's work) and joins
    the tape as one task over the same tensors and the same host arguments."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None:
        yield
        return
    launch = interpreter.GridExecutor.__call__

    def recorded(executor, *args, **kwargs):
        graph = TapeGraph.capturing
        if graph is None:
            return launch(executor, *args, **kwargs)
        run = functools.partial(launch, executor)
        with _disable_current_modes():
            run(*args, **kwargs)
        graph.record(Task(run, args, kwargs))
        return None

    interpreter.GridExecutor.__call__ = recorded
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = launch


class SimGraphBackend(CPUBackend):
    """The CUDA plugin's buckets, attention and executor on the CPU."""

    name = "cpu-simgraph"
    capabilities = CUDABackend.capabilities
    fail = False
    executor_kwargs: dict = {}

    def bucket_policy(self):
        return graph_bucket_policy(self.config)

    attention = staticmethod(sdpa_paged_attention)

    def op_overrides(self, dtype):
        """None: the CPU's fused modules call C++ kernels that a simulated graph (a tape of torch ops and
        Triton launches) cannot record."""
        return {}

    def make_executor(self, model):
        config = self.config
        return StaticGraphExecutor(model, SimGraphAPI(self.fail), max_num_seqs=config.scheduler.max_num_seqs,
                                   enforce_eager=config.runner.enforce_eager, **self.executor_kwargs)


class FailingSimGraphBackend(SimGraphBackend):
    name = "cpu-simgraph-fail"
    fail = True


class ShortSimGraphBackend(SimGraphBackend):
    name = "cpu-simgraph-short"  # one context width of 32 tokens: longer decodes run eagerly
    executor_kwargs = dict(max_seq_len_to_capture=32)


class _SimPlugin:
    PLUGIN_API_VERSION = "1.0"
    @staticmethod
    @hookimpl
    def polyrunner_backends():
        return [SimGraphBackend, FailingSimGraphBackend, ShortSimGraphBackend]


@pytest.fixture(scope="module")
def sim_backend():
    register(_SimPlugin, name="test-simgraph")
    yield
    unregister("test-simgraph")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-cuda"))


def _prompts(n=10, vocab=512, seed=0):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, size=20).tolist()  # a shared prefix: prefix-cache hits
    return [(shared if i % 3 == 0 else []) + rng.integers(3, vocab, size=int(rng.integers(2, 40))).tolist()
            for i in range(n)]


_EXPECTED: dict = {}


def _expected(folder, **kw):
    key = (str(folder), tuple(sorted(kw.items())))
    if key not in _EXPECTED:
        _EXPECTED[key] = _generate(folder, "cpu", **kw)[1]
    return _EXPECTED[key]


def _generate(folder, backend, max_tokens=8, **kw):
    from polyrunner import LLM, SamplingParams
    kw.setdefault("max_num_batched_tokens", 128)
    llm = LLM(str(folder), backend=backend, dtype="float32", max_num_seqs=kw.pop("max_num_seqs", 8),
              block_size=16, kv_cache_memory_bytes=kw.pop("kv", 4 << 20), **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_simulated_graphs_match_cpu_reference(sim_backend, tiny_llama):
    expected = _expected(tiny_llama)
    llm, got = _generate(tiny_llama, "cpu-simgraph")
    ex = llm.engine.runner.executor
    assert got == expected
    assert ex.num_graphs() == 4 and sorted(ex.graphs) == [1, 2, 4, 8] and ex._width == 32
    assert ex.api.captures == 4 and ex.api.replays > 0  # decode steps replayed graphs
    counts = ex.counters()
    assert counts["replays"] == ex.api.replays and counts["eager"]["mixed"] > 0
    assert set(counts["eager"]) <= {"mixed", "not_captured", "too_large"}
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, use_tqdm=False)
    assert ex.num_graphs() == 4 and ex.api.captures == 4  # no growth after warm-up


def test_simulated_graphs_long_context_runs_eager(sim_backend, tiny_llama, caplog):
    expected = _expected(tiny_llama)
    with caplog.at_level(logging.WARNING):
        llm, got = _generate(tiny_llama, "cpu-simgraph-short")
    ex = llm.engine.runner.executor
    assert got == expected and ex._width == 2
    assert ex.counters()["eager"]["long_context"] > 0
    assert "exceeds the graphs' width" in caplog.text
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)  # a short context fits the width
    assert ex.counters()["replays"] > 0


def test_simulated_graphs_chunked_prefill(sim_backend, tiny_llama):
    expected = _expected(tiny_llama, max_num_batched_tokens=16)
    _, got = _generate(tiny_llama, "cpu-simgraph", max_num_batched_tokens=16)
    assert got == expected


def test_capture_failure_is_an_error_unless_eager(sim_backend, tiny_llama):
    with pytest.raises(RuntimeError) as err:
        _generate(tiny_llama, "cpu-simgraph-fail")
    msg = str(err.value)
    assert "capturing the decode graph for 8 tokens (8 requests) failed" in msg   # what, at which size
    assert "operation not permitted" in msg                                         # the device's reason
    assert "enforce_eager=True" in msg and 'cudagraph_mode="NONE"' in msg and "gpu_memory_utilization" in msg
    llm, got = _generate(tiny_llama, "cpu-simgraph-fail", enforce_eager=True)     # no capture, no error
    assert got == _expected(tiny_llama) and llm.engine.runner.executor.num_graphs() == 0


def test_batch_above_largest_graph_runs_eager(sim_backend, tiny_llama, caplog):
    expected = _expected(tiny_llama)
    with caplog.at_level(logging.WARNING):
        llm, got = _generate(tiny_llama, "cpu-simgraph", token_buckets=[1, 2])
    assert got == expected and llm.engine.runner.executor.num_graphs() == 2
    assert "exceeds the largest captured graph" in caplog.text
    assert llm.engine.runner.executor.counters()["eager"]["too_large"] > 0


def test_enforce_eager_captures_nothing(sim_backend, tiny_llama):
    llm, got = _generate(tiny_llama, "cpu-simgraph", enforce_eager=True)
    assert llm.engine.runner.executor.num_graphs() == 0
    assert llm.engine.runner.buckets.token_buckets == []


def _random_decode_inputs(runner, B, W, seed):
    """A decode-only batch of B requests at random positions below W blocks (the
    first at the last position), each on distinct random blocks."""
    from polyrunner.runner.inputs import dummy_step
    rng = np.random.default_rng(seed)
    bs = runner.block_size
    step = dummy_step(B, B, runner.max_blocks_per_req)
    pos = rng.integers(0, W * bs, size=B)
    pos[0] = W * bs - 1
    blocks = rng.permutation(np.arange(1, runner.num_blocks))[: B * W].reshape(B, W).astype(np.int32)
    step.block_tables[:, :W] = blocks
    step.input_ids = rng.integers(3, 500, size=B).astype(np.int64)
    step.positions = pos.astype(np.int64)
    step.seq_lens = (pos + 1).astype(np.int32)
    step.max_seq_len = int(pos.max() + 1)
    step.slot_mapping = blocks[np.arange(B), pos // bs].astype(np.int64) * bs + pos % bs
    gen = torch.Generator().manual_seed(seed)
    for cache in runner.kv_caches:  # the backend may leave KV memory uninitialised: give it values
        cache.copy_(torch.randn(cache.shape, generator=gen, dtype=torch.float32).to(cache.dtype))
    return runner._to_device(step)


def _check_every_bucket(llm, atol):
    runner = llm.engine.runner
    ex = runner.executor
    assert ex.num_graphs() > 0
    W = ex._width
    for B in sorted(ex.graphs):
        inputs = _random_decode_inputs(runner, B, W, seed=B * 100 + W)
        assert ex._dispatch(inputs) == ("decode", B)
        with torch.inference_mode():
            eager = ex.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches).clone()
            graph = ex.run(inputs).clone()
        torch.testing.assert_close(graph, eager, rtol=atol, atol=atol, msg=f"bucket {B}")


@pytest.mark.parametrize("backend", ["cpu-simgraph", "cpu-simgraph-short"])
def test_simulated_graph_equals_eager_every_bucket(sim_backend, tiny_llama, backend):
    llm, _ = _generate(tiny_llama, backend, max_tokens=1)
    _check_every_bucket(llm, 1e-4)


# ---- real CUDA ------------------------------------------------------------------------
@needs_cuda
def test_cuda_probe_and_primitives():
    av = CUDABackend.probe()
    assert av.available, av.reason
    be = CUDABackend(_config())
    assert be.device.type == "cuda" and be.default_dtype in (torch.bfloat16, torch.float16)
    x = torch.arange(10, device="cuda")
    fut = be.to_host_async(x * 2)
    out = fut.result()
    assert out.is_pinned() and out.tolist() == list(range(0, 20, 2))
    up = be.to_device(np.arange(5, dtype=np.int32))
    assert up.device.type == "cuda" and up.cpu().tolist() == list(range(5))
    g = be.make_generator(7)
    assert g.device.type == "cuda"
    free, total = be.memory_info()
    assert 0 < free <= total


@needs_cuda
def test_cuda_kv_budget_formula():
    cfg = _config()
    cfg.cache.memory_utilization = 0.5
    be = CUDABackend(cfg)
    held = []
    budget = be.kv_cache_budget(0, lambda: held.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda")))
    free, total = torch.cuda.mem_get_info()
    assert 0 < budget < total * 0.5 - (256 << 20) + (64 << 20)
    cfg.cache.kv_cache_memory_bytes = 12345
    assert be.kv_cache_budget(0, lambda: None) == 12345


@needs_cuda
def test_cuda_attention_matches_reference():
    bs, nb, D = 16, 64, 64
    spec = LayerSpec(8, 2, D, D ** -0.5)
    reqs = BATCHES["mixed"]
    T = sum(n for _, n in reqs)
    meta = make_batch(reqs, block_size=bs, num_blocks=nb, max_blocks=12, seed=1, device="cuda")
    q, k, v = _qkv(T, spec, seed=2, device="cuda")
    cache = torch.randn(2, nb, bs, 2, D, generator=torch.Generator().manual_seed(3)).to("cuda")
    expected, bound = attention_reference(q, k, v, cache, meta, spec)   # float64 on the host
    fast = sdpa_paged_attention(q, k, v, cache.clone(), meta, spec)
    assert_detects_errors(lambda out: assert_close_ulp(out, expected, torch.float32, ulps=1, abs_err=bound), fast)


@needs_cuda
def test_cuda_graphs_match_eager_and_cpu(tiny_llama):
    cpu = _expected(tiny_llama)
    _, eager = _generate(tiny_llama, "cuda", enforce_eager=True)
    llm, graphs = _generate(tiny_llama, "cuda")
    ex = llm.engine.runner.executor
    n = ex.num_graphs()
    assert sorted(ex.graphs) == [1, 2, 4, 8] and ex.mode == "FULL" and ex.fallback_reason is None
    assert sorted(ex.mixed_graphs) == [2, 4] + list(range(8, 129, 8)) and n == 4 + 18
    assert graphs == eager
    assert sum(a == b for a, b in zip(graphs, cpu)) >= len(cpu) - 1  # fp32 kernels may flip a rare tie
    assert ex.counters()["mixed_replays"] > 0
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 5, use_tqdm=False)
    assert ex.num_graphs() == n  # no capture after warm-up
    _check_every_bucket(llm, 1e-3)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
