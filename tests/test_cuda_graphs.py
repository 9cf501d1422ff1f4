"""Graph keying, capture sizes, counters and the worst-case memory profile.

CPU-only: graphs are simulated (`SimGraphAPI` in test_cuda_backend: replay
re-runs the captured function on the static buffers). The Triton case runs
the kernels under Triton's interpreter and skips where triton is missing.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from polyrunner.device.backend import ModelInputs
from polyrunner.device.buckets import cudagraph_capture_sizes, decode_capture_sizes
from polyrunner.device.graphs import StaticGraphExecutor, graph_bucket_policy, worst_case_profile
from polyrunner.plugins import hookimpl, register
from polyrunner.plugins.manager import unregister
from test_cuda_backend import SimGraphAPI, SimGraphBackend, _config, _expected, _generate, make_batch


# ---- capture sizes -----------------------------------------------------------------
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
    assert ex._dispatch(_inputs([(5, 1), (100, 1), (0, 1)], R_pad=4, T_pad=4)) == 4  # any lengths, one key
    assert ex._dispatch(_inputs([(5, 1), (17, 1)])) == 2
    assert ex._dispatch(_inputs([(5, 1), (0, 9)])) is None                            # mixed
    assert ex._dispatch(_inputs([(1, 1)] * 3)) is None                                # 3: no graph
    assert ex._dispatch(_inputs([(1, 1)] * 9)) is None                                # above 8
    assert ex._dispatch(_inputs([(1, 1)] * 2, R_pad=4, T_pad=2)) is None              # padding mismatch
    assert ex.counters()["eager"] == {"mixed": 1, "not_captured": 1, "too_large": 1, "shape": 1}
    assert ex.eager_steps["no_graphs"] == 0
    narrow = _executor(length_adaptive=False, width=2)  # fallback: 32 tokens per request in a graph
    narrow._kv = []
    assert narrow._dispatch(_inputs([(5, 1), (30, 1)])) == 2
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

    class _Plugin:
        PLUGIN_API_VERSION = "1.0"
        @staticmethod
        @hookimpl
        def polyrunner_backends():
            return [TritonSimBackend]

    register(_Plugin, name="test-triton-sim")
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
