"""What a CUDA graph capture refuses, refused by the CPU stand-in (`SimGraphAPI`: tape graphs
under the core's capture guard), and the emulated graph's replay semantics.

- a host sync planted in a captured decode step (`.item()`, `.tolist()`, a boolean mask) fails
  the engine's start-up with `HostSyncError`, naming the op and the graph; without graphs
  (enforce_eager) the same model runs;
- a tiny Mixtral's decode steps are captured and replayed with the core's reference MoE (the
  CUDA backend without Triton), tokens equal to the CPU backend's; the MoE's grouped path (a
  host read of per-expert counts) would fail that capture;
- `TapeGraph`: a replay re-runs the recorded ops on the recorded tensors: inputs copied into
  the static buffers are read again, host values read at capture stay frozen, and a result
  written to a tensor the graph does not read stays unread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrunner.attention.batched import sdpa_paged_attention
from polyrunner.device.capture_guard import HostSyncError
from polyrunner.device.tape_graph import TapeGraph
from polyrunner.ops import moe
from polyrunner.plugins.manager import unregister
from test_cuda_backend import SimGraphBackend, tiny_llama  # noqa: F401 - the fixture
from test_cuda_graphs import register_backend


def _planted(sync):
    """The stand-in's attention with a host sync `sync(q)` planted in every layer."""
    def attention(q, k, v, kv_cache, meta, spec):
        sync(q)
        return sdpa_paged_attention(q, k, v, kv_cache, meta, spec)
    return staticmethod(attention)


PLANTED = {
    "item": (lambda q: q[0, 0, 0].item(), "Tensor.item()"),
    "tolist": (lambda q: q[0].tolist(), "Tensor.tolist()"),
    "bool_mask": (lambda q: q[q > 0], "boolean mask"),
}


def _llm(folder, backend, **kw):
    from polyrunner import LLM
    return LLM(str(folder), backend=backend, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
               block_size=16, kv_cache_memory_bytes=4 << 20, **kw)


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_host_sync_in_a_captured_step_fails_start_up(tiny_llama, name):  # noqa: F811
    sync, what = PLANTED[name]

    class Planted(SimGraphBackend):
        attention = _planted(sync)

    Planted.name = f"cpu-simgraph-planted-{name}"
    register_backend(Planted, Planted.name)
    try:
        with pytest.raises(HostSyncError) as err:
            _llm(tiny_llama, Planted.name)
        msg = str(err.value)
        assert what in msg and "capturing the decode graph for 4 tokens (4 requests) failed" in msg
        assert "enforce_eager=True" in msg
        llm = _llm(tiny_llama, Planted.name, enforce_eager=True)   # eager steps may sync: no capture
        assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)[0].outputs[0].token_ids) > 0
    finally:
        unregister(Planted.name)


class ReferenceOpsSimGraph(SimGraphBackend):
    """The stand-in with the core's reference modules (the CUDA backend without Triton)."""

    name = "cpu-simgraph-reference-ops"

    def op_overrides(self, dtype):
        return {}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from moe_tiny_models import build_moe_model
    folder = tmp_path_factory.mktemp("mixtral-capture")
    build_moe_model("mixtral", folder)
    return folder


def _mixtral_tokens(llm):
    from polyrunner import SamplingParams
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, size=int(rng.integers(3, 30))).tolist()} for _ in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_mixtral_decode_steps_are_captured_without_a_host_sync(mixtral):
    register_backend(ReferenceOpsSimGraph, ReferenceOpsSimGraph.name)
    try:
        expected = _mixtral_tokens(_llm(mixtral, "cpu"))
        llm = _llm(mixtral, ReferenceOpsSimGraph.name)
        ex = llm.engine.runner.executor
        assert sorted(ex.graphs) == [1, 2, 4]
        assert _mixtral_tokens(llm) == expected
        assert ex.counters()["replays"] > 0
    finally:
        unregister(ReferenceOpsSimGraph.name)


def test_mixtral_grouped_moe_path_fails_the_capture(mixtral, monkeypatch):
    """Without the fixed-shape path (the MoE reference as it was), the capture fails."""
    monkeypatch.setattr(moe, "in_static_step", lambda: False)
    register_backend(ReferenceOpsSimGraph, ReferenceOpsSimGraph.name)
    try:
        with pytest.raises(HostSyncError, match="bincount"):
            _llm(mixtral, ReferenceOpsSimGraph.name)
    finally:
        unregister(ReferenceOpsSimGraph.name)


# ---- the emulated graph ------------------------------------------------------------------------
def _capture(fn):
    graph = TapeGraph()
    return graph, graph.capture(fn)


def test_replay_reads_the_static_buffers_again():
    x = torch.ones(4)
    graph, out = _capture(lambda: (x * 2).add_(1).sum(0, keepdim=True))
    assert out.item() == 12
    x.copy_(torch.arange(4.0))
    graph.replay()
    assert out.item() == 16 and graph.replays == 1


def test_replay_keeps_host_values_frozen():
    scale = {"value": 2.0}
    x = torch.ones(3)
    graph, out = _capture(lambda: x * scale["value"])
    scale["value"] = 5.0           # the Python that built the graph does not run again
    graph.replay()
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_a_result_the_graph_does_not_read_stays_stale():
    """A functional op re-issued outside the graph writes a fresh tensor: the graph's output
    keeps what its own recorded ops compute, nothing else."""
    x = torch.ones(2)
    graph, out = _capture(lambda: x + 1)
    fresh = x + 10                 # issued after capture: not on the tape
    graph.replay()
    assert out.tolist() == [2.0, 2.0] and fresh.tolist() == [11.0, 11.0]
    x.fill_(3)
    graph.replay()
    assert out.tolist() == [4.0, 4.0]


def test_one_capture_at_a_time():
    graph = TapeGraph()
    graph.capture_begin()
    try:
        with pytest.raises(RuntimeError, match="another graph"):
            TapeGraph().capture_begin()
        with pytest.raises(RuntimeError, match="replay during a capture"):
            TapeGraph().replay()
    finally:
        graph.capture_end()

