"""Graph keying, capture sizes, counters and the worst-case memory profile.

CPU-only: graphs are simulated (`SimGraphAPI` in test_cuda_backend: a replay
re-executes the ops recorded at capture on the static buffers). The Triton case runs
the kernels under Triton's interpreter and skips where triton is missing.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from polyrunner.device.backend import ModelInputs
from polyrunner.device.buckets import cudagraph_capture_sizes, decode_capture_sizes
from polyrunner.device.graphs import StaticGraphExecutor, graph_bucket_policy, worst_case_profile
from polyrunner.plugins import hookimpl, register
from polyrunner.plugins.manager import unregister
from test_cuda_backend import SimGraphAPI, SimGraphBackend, _config, _expected, _generate, make_batch


# ---- capture sizes -----------------------------------------------------------------
def register_backend(cls, name: str) -> None:
    """Register a plugin offering backend class `cls` under plugin name `name` (unregister after)."""
    class _Plugin:
        PLUGIN_API_VERSION = "1.0"

        @staticmethod
        @hookimpl
        def polyrunner_backends():
            return [cls]
    register(_Plugin, name=name)


def vllm_sizes(max_num_seqs):
    """vLLM's documented default, written out independently."""
    top = min(max_num_seqs * 2, 512)
    return [s for s in [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, top + 1, 16)) if s <= top]


@pytest.mark.parametrize("seqs", [1, 3, 8, 100, 128, 256, 300, 1024])
def test_capture_sizes_follow_vllm(seqs):
    assert cudagraph_capture_sizes(seqs, 1 << 20) == vllm_sizes(seqs)
    assert cudagraph_capture_sizes(seqs, 40) == [s for s in vllm_sizes(seqs) if s <= 40]


@pytest.mark.parametrize("seqs,expected_top", [(1, 1), (6, 8), (8, 8), (100, 104), (256, 256), (1024, 512)])
def test_decode_sizes_cover_every_decode_batch(seqs, expected_top):
    sizes = decode_capture_sizes(cudagraph_capture_sizes(seqs, 1 << 20), seqs)
    assert sizes[-1] == expected_top and sizes == sorted(set(sizes))
    assert all(s <= seqs for s in sizes[:-1])
    policy = graph_bucket_policy(_config(max_num_seqs=seqs, max_num_batched_tokens=1 << 16))
    assert policy.token_buckets == sizes == policy.request_buckets
    for b in range(1, min(seqs, 512) + 1):  # every decode batch pads to a captured size
        assert policy.pad(b, b)[0] in sizes


# ---- dispatch: keys are the padded batch size alone ---------------------------------------
def _executor(length_adaptive, width, sizes=(1, 2, 4, 8)):
    ex = StaticGraphExecutor(torch.nn.Identity(), SimGraphAPI(), max_num_seqs=8, length_adaptive=length_adaptive)
    ex.graphs = {b: None for b in sizes}
    ex._width, ex._block_size = width, 16
    return ex


def _inputs(reqs, R_pad=None, T_pad=None):
    meta = make_batch(reqs, block_size=16, num_blocks=64, max_blocks=8, R_pad=R_pad, T_pad=T_pad)
    return ModelInputs(torch.zeros(meta.num_padded_tokens, dtype=torch.long), meta.positions, meta, [],
                       torch.zeros(meta.num_padded_reqs, dtype=torch.long))


def test_dispatch_by_batch_size_and_counted_reasons():
    ex = _executor(length_adaptive=True, width=8)  # the whole 8-block table: 128 tokens
    ex._kv = []
    assert ex._dispatch(_inputs([(5, 1), (100, 1), (0, 1)], R_pad=4, T_pad=4)) == ("decode", 4)  # any lengths, one key
    assert ex._dispatch(_inputs([(5, 1), (17, 1)])) == ("decode", 2)
    assert ex._dispatch(_inputs([(5, 1), (0, 9)])) is None                            # mixed
    assert ex._dispatch(_inputs([(1, 1)] * 3)) is None                                # 3: no graph
    assert ex._dispatch(_inputs([(1, 1)] * 9)) is None                                # above 8
    assert ex._dispatch(_inputs([(1, 1)] * 2, R_pad=4, T_pad=2)) is None              # padding mismatch
    assert ex.counters()["eager"] == {"mixed": 1, "not_captured": 1, "too_large": 1, "shape": 1}
    assert ex.eager_steps["no_graphs"] == 0
    narrow = _executor(length_adaptive=False, width=2)  # fallback: 32 tokens per request in a graph
    narrow._kv = []
    assert narrow._dispatch(_inputs([(5, 1), (30, 1)])) == ("decode", 2)
    assert narrow._dispatch(_inputs([(5, 1), (40, 1)])) is None
    assert narrow.counters()["eager"] == {"long_context": 1}
    empty = _executor(length_adaptive=True, width=8, sizes=())
    assert empty._dispatch(_inputs([(1, 1)])) is None and empty.counters()["eager"] == {"no_graphs": 1}


# ---- memory ------------------------------------------------------------------------------
def test_pool_reserve_and_worst_case_profile():
    policy = graph_bucket_policy(_config(max_num_seqs=8, max_num_batched_tokens=64))
    ex = StaticGraphExecutor(torch.nn.Identity(), SimGraphAPI(), max_num_seqs=8)
    assert ex.pool_reserve_bytes(1000.0, policy) == 8 * 1000 + 4 * (2 << 20)  # sizes 1, 2, 4, 8
    ex.enforce_eager = True
    assert ex.pool_reserve_bytes(1000.0, policy) == 0
    calls = []
    worst_case_profile(lambda worst_case=False: calls.append(worst_case))()
    worst_case_profile(lambda: calls.append("plain"))()
    assert calls == [True, "plain"]


class ProfilingSimBackend(SimGraphBackend):
    """Runs the worst-case profile and records what it ran."""

    name = "cpu-simgraph-profile"
    seen: dict = {}

    def kv_cache_budget(self, weights_bytes, profile):
        ex = self.executor
        run, sample = ex.run, ex.sample
        seen = ProfilingSimBackend.seen
        seen.clear()

        def spy_run(inputs):
            seen.setdefault("max_seq_len", []).append(inputs.attn.max_seq_len)
            return run(inputs)

        def spy_sample(logits, meta):
            seen.setdefault("sample_rows", []).append(meta.num_reqs)
            return sample(logits, meta)

        ex.run, ex.sample = spy_run, spy_sample
        try:
            worst_case_profile(profile)()
        finally:
            del ex.run, ex.sample
        return self.config.cache.kv_cache_memory_bytes


class _ProfilePlugin:
    PLUGIN_API_VERSION = "1.0"
    @staticmethod
    @hookimpl
    def polyrunner_backends():
        return [ProfilingSimBackend]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from test_cuda_backend import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-graphs"))


def test_profile_covers_longest_prefill_and_sampler(tiny_llama):
    register(_ProfilePlugin, name="test-profile")
    try:
        llm, got = _generate(tiny_llama, "cpu-simgraph-profile", max_model_len=256)
    finally:
        unregister("test-profile")
    seen = ProfilingSimBackend.seen
    assert max(seen["max_seq_len"]) == 256       # a chunk at the end of a max_model_len context
    assert seen["sample_rows"] == [8]            # the sampler over max_num_seqs rows
    assert got == _expected(tiny_llama)          # and it left no sampling state behind


# ---- the Triton kernel inside (simulated) graphs ----------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter case is for CPU-only machines")
def test_triton_attention_graphs_one_key_per_batch_size(tiny_llama):
    os.environ["TRITON_INTERPRET"] = "1"
    from polyrunner.backends.cuda.triton_attention import triton_paged_attention

    class TritonSimBackend(SimGraphBackend):
        name = "cpu-simgraph-triton"
        attention = staticmethod(triton_paged_attention)
        executor_kwargs = dict(length_adaptive=True)


    register_backend(TritonSimBackend, "test-triton-sim")
    try:
        from polyrunner import LLM, SamplingParams
        prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9] * 4, [11, 12, 13])]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = {}
        for backend in ("cpu", "cpu-simgraph-triton"):
            llm = LLM(str(tiny_llama), backend=backend, dtype="float32", max_num_seqs=2, block_size=16,
                      max_num_batched_tokens=64, max_model_len=64, kv_cache_memory_bytes=1 << 20)
            outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        ex = llm.engine.runner.executor
    finally:
        unregister("test-triton-sim")
    assert outs["cpu-simgraph-triton"] == outs["cpu"]
    assert sorted(ex.graphs) == [1, 2] and ex._width == 4  # the whole block table, one graph per size
    assert ex.counters()["replays"] >= 2


# ---- FULL mode: mixed prefill + decode steps in (simulated) graphs, Triton under the interpreter ---------
@pytest.fixture(scope="module")
def triton_full(tiny_llama):
    """An engine on the CPU with the CUDA plugin's FULL-mode executor and Triton attention
    (interpreter), simulated graphs: max_num_seqs 4, 16 tokens a step (mixed graphs 2, 4, 8, 16)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("the interpreter case is for CPU-only machines")
    os.environ["TRITON_INTERPRET"] = "1"
    from polyrunner.backends.cuda.triton_attention import triton_paged_attention

    class TritonFullSimBackend(SimGraphBackend):
        name = "cpu-simgraph-triton-full"
        attention = staticmethod(triton_paged_attention)
        executor_kwargs = dict(length_adaptive=True, mode="FULL")

        def bucket_policy(self):
            return graph_bucket_policy(self.config, mode=self.executor.mode)


    from polyrunner import LLM
    register_backend(TritonFullSimBackend, "test-triton-full")
    kw = dict(dtype="float32", max_num_seqs=4, block_size=16, max_num_batched_tokens=16, max_model_len=64,
              kv_cache_memory_bytes=1 << 20)
    try:
        yield LLM(str(tiny_llama), backend="cpu-simgraph-triton-full", **kw), LLM(str(tiny_llama), backend="cpu", **kw)
    finally:
        unregister("test-triton-full")


def _mixed_step(runner, reqs, seed):
    """A step of requests `(context, new tokens)` (decodes first) on distinct random
    blocks, padded as the runner pads it; random KV contents. -> (inputs, T, slots written)."""
    from polyrunner.attention.metadata import NULL_BLOCK, NULL_SLOT
    from polyrunner.runner.inputs import StepInputs
    rng = np.random.default_rng(seed)
    bs, W = runner.block_size, runner.max_blocks_per_req
    R, T = len(reqs), sum(n for _, n in reqs)
    T_pad, R_pad = runner.buckets.pad(T, R)
    perm = rng.permutation(np.arange(1, runner.num_blocks))
    tables = np.full((R_pad, W), NULL_BLOCK, np.int32)
    ctx = np.array([c for c, _ in reqs]), np.array([n for _, n in reqs])
    for r, (c, n) in enumerate(reqs):
        nb = -(-(c + n) // bs)
        tables[r, :nb] = perm[r * W: r * W + nb]
    req = np.repeat(np.arange(R), ctx[1])
    pos = ctx[0][req] + (np.arange(T) - np.repeat(np.cumsum(ctx[1]) - ctx[1], ctx[1]))
    slots = tables[req, pos // bs].astype(np.int64) * bs + pos % bs
    qsl = np.full(R_pad + 1, T, np.int32)
    qsl[0], qsl[1:R + 1] = 0, np.cumsum(ctx[1])
    pad_t = lambda a, fill: np.concatenate([a, np.full(T_pad - T, fill, a.dtype)])  # noqa: E731
    seq_lens = np.zeros(R_pad, np.int32)
    seq_lens[:R] = ctx[0] + ctx[1]
    step = StepInputs(
        num_tokens=T, num_reqs=R, num_decodes=int(np.argmax(ctx[1] != 1)), max_query_len=int(ctx[1].max()),
        max_seq_len=int(seq_lens.max()), input_ids=pad_t(rng.integers(3, 250, T).astype(np.int64), 0),
        positions=pad_t(pos.astype(np.int64), 0), slot_mapping=pad_t(slots, NULL_SLOT),
        token_to_req=pad_t(req.astype(np.int32), 0), query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
        logits_indices=np.zeros(R_pad, np.int64), discard=np.zeros(R, bool))
    gen = torch.Generator().manual_seed(seed)
    for cache in runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return runner._to_device(step), T, slots


def test_mixed_batch_in_a_full_graph_equals_eager(triton_full):
    """Prefill chunks, decodes and a chunked prefill with context replay mixed graph 16
    (4 requests, one of them padded) and give eager's hidden states; padded requests and
    tokens write nothing but the null block."""
    llm, _ = triton_full
    runner = llm.engine.runner
    ex = runner.executor
    assert ex.mode == "FULL" and sorted(ex.mixed_graphs) == [2, 4, 8, 16] and sorted(ex.graphs) == [1, 2, 4]
    assert {t: g.reqs for t, g in ex.mixed_graphs.items()} == {2: 2, 4: 4, 8: 4, 16: 4}
    reqs = [(20, 1), (0, 6), (17, 4)]   # a decode, a fresh prefill chunk, a chunk after 17 cached tokens
    inputs, T, slots = _mixed_step(runner, reqs, seed=3)
    assert inputs.input_ids.shape[0] == 16 and inputs.attn.num_padded_reqs == 4 and T == 11
    before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        replays = ex.counters()["mixed_replays"]
        graph = ex.run(inputs).clone()
        assert ex.counters()["mixed_replays"] == replays + 1
        written = [c.clone() for c in runner.kv_caches]
        eager = ex.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches).clone()
    torch.testing.assert_close(graph[:T], eager[:T], rtol=1e-4, atol=1e-4)
    bs = runner.block_size
    for old, new in zip(before, written):   # [2, blocks, bs, Hkv, D]
        flat_old, flat_new = old.flatten(1, 2), new.flatten(1, 2)
        changed = (flat_old != flat_new).any(-1).any(-1).any(0).nonzero().flatten().tolist()
        assert set(changed) <= set(slots.tolist()) | set(range(bs)), "a padded row wrote outside the null block"
        assert set(slots.tolist()) <= set(changed)


def test_full_mode_generation_matches_cpu_and_replays_mixed_graphs(triton_full):
    """Chunked prefill under a 16-token budget: most steps are mixed; every one of them
    replays a mixed graph, padded as its graph expects (padded requests inert), and the
    tokens equal the CPU backend's."""
    from polyrunner import SamplingParams
    llm, cpu = triton_full
    ex = llm.engine.runner.executor
    seen = []
    run = ex.run

    def spy(inputs):
        m = inputs.attn
        if m.max_query_len > 1:
            seen.append((inputs.input_ids.shape[0], m.num_padded_reqs, m.num_actual_tokens, m.num_reqs,
                         m.query_start_loc.tolist(), m.seq_lens.tolist(), m.slot_mapping.tolist()))
        return run(inputs)

    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9] * 5, [11, 12, 13], list(range(30, 52)), [40] * 9)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    before = dict(ex.counters())
    ex.run = spy
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        del ex.run
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    counts = ex.counters()
    assert counts["mixed_replays"] - before["mixed_replays"] == len(seen) > 0
    assert counts["eager"].get("mixed", 0) == before["eager"].get("mixed", 0)
    for T_pad, R_pad, T, R, qsl, seq_lens, slot_mapping in seen:
        assert T_pad in (2, 4, 8, 16) and R_pad == min(T_pad, 4)
        assert qsl[R + 1:] == [T] * (R_pad - R) and seq_lens[R:] == [0] * (R_pad - R)   # query length 0
        assert slot_mapping[T:] == [0] * (T_pad - T)                                    # the null slot
    assert ex.num_graphs() == 7   # nothing captured while serving


# ---- the CUDA plugin's attention choice ------------------------------------------------------
def test_attention_falls_back_to_sdpa_with_a_warning(monkeypatch, caplog):
    import importlib.util as iu
    import logging

    from polyrunner.attention.batched import sdpa_paged_attention
    from polyrunner.backends.cuda import plugin
    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with caplog.at_level(logging.WARNING):
        assert plugin.load_attention() == (sdpa_paged_attention, False)
    assert "triton is not installed" in caplog.text
    monkeypatch.setattr(iu, "find_spec", real)
    monkeypatch.setenv("POLYRUNNER_CUDA_TRITON", "0")
    assert plugin.load_attention() == (sdpa_paged_attention, False)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_attention_is_triton_when_installed():
    from polyrunner.backends.cuda import plugin
    op, length_adaptive = plugin.load_attention()
    assert op.__name__ == "triton_paged_attention" and length_adaptive
