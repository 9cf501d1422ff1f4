"""Graph modes (vLLM's cudagraph_mode names): the option's validation, the mode
each backend runs, FULL mode's padding of mixed steps and the executor's choice
of graph (or eager reason) per step. No engine, no GPU; the mixed graphs'
numerics (Triton under the interpreter) are in test_cuda_graphs (slow)."""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import ValidationError

from polyrunner.config import EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from polyrunner.device.backend import ModelInputs
from polyrunner.device.graphs import (
    FullGraphBucketPolicy,
    GraphBucketPolicy,
    StaticGraphExecutor,
    _Graph,
    graph_bucket_policy,
    mixed_token_sizes,
    requested_graph_mode,
    resolve_graph_mode,
)
from test_cuda_backend import SimGraphAPI, make_batch


def _config(runner=None, **sched):
    return EngineConfig(model=ModelConfig(), scheduler=SchedulerConfig(**sched), runner=runner or RunnerConfig())


# ---- the option ----------------------------------------------------------------------
def test_cudagraph_mode_option_is_validated():
    assert RunnerConfig().cudagraph_mode is None
    assert RunnerConfig(cudagraph_mode="full").cudagraph_mode == "FULL"   # vLLM's names, any case
    assert RunnerConfig(cudagraph_mode="FULL_DECODE_ONLY").cudagraph_mode == "FULL_DECODE_ONLY"
    with pytest.raises(ValidationError, match=r"cudagraph_mode(.|\n)*'NONE', 'FULL_DECODE_ONLY', 'FULL'"):
        RunnerConfig(cudagraph_mode="FAST")
    with pytest.raises(ValidationError, match="piecewise graphs need torch.compile"):
        RunnerConfig(cudagraph_mode="FULL_AND_PIECEWISE")
    with pytest.raises(ValidationError, match="cudagraph_mode"):
        RunnerConfig(cudagraph_mode=3)


def test_llm_takes_cudagraph_mode():
    from polyrunner import LLM
    with pytest.raises(ValidationError, match="cudagraph_mode"):
        LLM(backend="cpu", cudagraph_mode="PIECEWISE")   # refused before any model loads
    from polyrunner.tools.engine_args import ENGINE_ARGS
    assert ENGINE_ARGS["cudagraph_mode"][0] == ("--cudagraph-mode",)


def test_mode_resolution_and_fallback(caplog):
    assert requested_graph_mode(_config(), "FULL") == "FULL"
    assert requested_graph_mode(_config(RunnerConfig(cudagraph_mode="FULL_DECODE_ONLY")), "FULL") == "FULL_DECODE_ONLY"
    assert requested_graph_mode(_config(RunnerConfig(cudagraph_mode="FULL", enforce_eager=True)), "FULL") == "NONE"
    assert resolve_graph_mode("FULL", True) == ("FULL", None)
    mode, why = resolve_graph_mode("FULL", False)
    assert mode == "FULL_DECODE_ONLY" and "length-adaptive" in why
    with caplog.at_level(logging.WARNING):
        ex = StaticGraphExecutor(torch.nn.Identity(), SimGraphAPI(), max_num_seqs=8, mode="FULL")
    assert ex.mode == "FULL_DECODE_ONLY" and ex.fallback_reason == why and why in caplog.text
    assert ex.counters()["mode"] == "FULL_DECODE_ONLY"
    eager = StaticGraphExecutor(torch.nn.Identity(), SimGraphAPI(), max_num_seqs=8, enforce_eager=True, mode="FULL")
    assert eager.mode == "NONE" and eager.capture_plan(graph_bucket_policy(_config())) == []
    none = StaticGraphExecutor(torch.nn.Identity(), SimGraphAPI(), max_num_seqs=8, mode="NONE")
    assert none.enforce_eager and none.pool_reserve_bytes(1e6, graph_bucket_policy(_config())) == 0


def _cuda_backend(config, length_adaptive):
    """The CUDA plugin's members that need no device."""
    from polyrunner.backends.cuda.plugin import CUDABackend
    be = object.__new__(CUDABackend)
    be.config, be.executor, be.length_adaptive = config, None, length_adaptive
    return be


@pytest.mark.parametrize("asked,adaptive,mode,policy", [
    (None, True, "FULL", FullGraphBucketPolicy), (None, False, "FULL_DECODE_ONLY", GraphBucketPolicy),
    ("FULL", False, "FULL_DECODE_ONLY", GraphBucketPolicy), ("FULL_DECODE_ONLY", True, "FULL_DECODE_ONLY",
                                                             GraphBucketPolicy),
    ("NONE", True, "NONE", type(None))])
def test_cuda_backend_default_mode(asked, adaptive, mode, policy):
    be = _cuda_backend(_config(RunnerConfig(cudagraph_mode=asked), max_num_seqs=8, max_num_batched_tokens=64),
                       adaptive)
    before = be.bucket_policy()   # before the executor exists: the mode it will run
    be.executor = be.make_executor(torch.nn.Identity())
    assert be.executor.mode == mode and be.executor.length_adaptive == adaptive
    after = be.bucket_policy()
    assert type(before) is type(after) and after == before
    assert type(after) is policy or (policy is type(None) and after.token_buckets == [])


# ---- FULL mode's padding ----------------------------------------------------------------
def test_mixed_capture_sizes():
    assert mixed_token_sizes(_config(max_num_batched_tokens=64)) == [2, 4] + list(range(8, 65, 8))
    assert mixed_token_sizes(_config(max_num_batched_tokens=100))[-2:] == [96, 100]   # the budget itself
    big = mixed_token_sizes(_config(max_num_batched_tokens=8192, max_num_seqs=4))
    assert big[-1] == 512 and all(s % 16 == 0 for s in big if s >= 256)             # vLLM's sizes to 512
    assert mixed_token_sizes(_config(RunnerConfig(token_buckets=[1, 4, 32, 99]), max_num_batched_tokens=64)) == [4, 32]


def test_full_policy_pads_mixed_steps_to_their_graph():
    p = graph_bucket_policy(_config(max_num_seqs=8, max_num_batched_tokens=64), mode="FULL")
    assert isinstance(p, FullGraphBucketPolicy) and p.decode_sizes == [1, 2, 4, 8] and p.request_cap == 8
    assert p.pad(3, 3) == (4, 4) and p.pad(8, 8) == (8, 8)        # decode steps: today's padding
    assert p.pad(5, 2) == (8, 8) and p.pad(3, 1) == (4, 4)        # mixed: tokens to a size, requests to its R
    assert p.pad(11, 3) == (16, 8) and p.pad(64, 8) == (64, 8)
    odd = graph_bucket_policy(_config(max_num_seqs=6, max_num_batched_tokens=40), mode="FULL")
    assert odd.request_cap == 8 and odd.pad(6, 6) == (8, 8) and odd.pad(7, 6) == (8, 8) and odd.pad(17, 2) == (24, 8)
    over = graph_bucket_policy(_config(max_num_seqs=8, max_num_batched_tokens=2048), mode="FULL")
    assert over.pad(600, 5) == (600, 8)                 # above 512: tokens unpadded (eager), requests to R_cap
    assert graph_bucket_policy(_config(max_num_seqs=8), mode="FULL_DECODE_ONLY").pad(11, 3) == (11, 4)


@pytest.mark.parametrize("mns,mnbt", [(8, 64), (6, 40), (3, 100), (1, 16), (32, 600)])
def test_full_policy_covers_every_batch_monotonic_and_bounded(mns, mnbt):
    """The conformance suite's bucket rules, over every legal (T, R)."""
    p = graph_bucket_policy(_config(max_num_seqs=mns, max_num_batched_tokens=mnbt), mode="FULL")
    tb, rb = set(p.token_buckets), set(p.request_buckets)
    seen = {}
    for T in range(1, mnbt + 1):
        for R in range(1, min(mns, T) + 1):
            Tp, Rp = seen[T, R] = p.pad(T, R)
            assert Tp >= T and Rp >= R
            assert (Tp in tb or Tp == T) and (Rp in rb or Rp == R)   # a bucket, or unpadded
            assert Tp - T <= p.max_padding(T, "tokens") and Rp - R <= p.max_padding(R, "requests")
            assert p.pad(Tp, Rp) == (Tp, Rp)                       # a padded shape pads to itself
    for (T, R), (Tp, Rp) in seen.items():
        for nxt in ((T + 1, R), (T, R + 1)):
            if nxt in seen:
                assert seen[nxt] >= (Tp, Rp) and seen[nxt][1] >= Rp, (T, R, nxt)
    assert len([b for b in p.request_buckets if b >= mns]) <= 1


# ---- which graph a step replays -----------------------------------------------------------
def _full_executor(decode=(1, 2, 4, 8), mixed=(2, 4, 8, 16, 32), cap=8):
    ex = StaticGraphExecutor(torch.nn.Identity(), SimGraphAPI(), max_num_seqs=8, mode="FULL", length_adaptive=True)
    ex.graphs = {b: _Graph(lambda: None, torch.zeros(1), b) for b in decode}
    ex.mixed_graphs = {t: _Graph(lambda: None, torch.zeros(1), min(t, cap)) for t in mixed}
    ex._width, ex._block_size, ex._kv = 8, 16, []
    return ex


def _inputs(reqs, T_pad=None, R_pad=None):
    meta = make_batch(reqs, block_size=16, num_blocks=64, max_blocks=8, R_pad=R_pad, T_pad=T_pad)
    return ModelInputs(torch.zeros(meta.num_padded_tokens, dtype=torch.long), meta.positions, meta, [],
                       torch.zeros(meta.num_padded_reqs, dtype=torch.long))


def test_full_executor_dispatch_and_reasons(caplog):
    ex = _full_executor()
    assert ex._dispatch(_inputs([(5, 1), (9, 1), (0, 1)], T_pad=4, R_pad=4)) == ("decode", 4)
    assert ex._dispatch(_inputs([(5, 1), (0, 7), (20, 3)], T_pad=16, R_pad=8)) == ("mixed", 16)  # chunk + context
    assert ex._dispatch(_inputs([(0, 2)], T_pad=2, R_pad=2)) == ("mixed", 2)
    assert ex._dispatch(_inputs([(3, 1 + 3), (7, 1 + 3)], T_pad=8, R_pad=8)) == ("mixed", 8)  # spec verify
    with caplog.at_level(logging.WARNING):
        assert ex._dispatch(_inputs([(0, 40)])) is None                             # above 32 tokens
        assert ex._dispatch(_inputs([(0, 9), (0, 3)], T_pad=16, R_pad=4)) is None  # not its graph's R
        assert ex._dispatch(_inputs([(0, 9), (0, 3)], T_pad=12, R_pad=8)) is None  # no graph of 12
    assert ex.counters()["eager"] == {"too_large": 1, "shape": 1, "not_captured": 1}
    assert "exceeds the largest mixed graph (32 tokens)" in caplog.text
    fdo = _full_executor(mixed=())
    assert fdo._dispatch(_inputs([(5, 1), (0, 7)], T_pad=8, R_pad=8)) is None
    assert fdo.counters()["eager"] == {"mixed": 1}
    other_kv = _full_executor()
    other_kv._kv, other_kv._kv_ptrs = [torch.zeros(1)], [1]
    assert other_kv._dispatch(_inputs([(0, 7)], T_pad=8, R_pad=8)) is None
    assert other_kv.counters()["eager"] == {"kv_caches": 1}


def test_capture_plan_largest_first_and_pool_reserve():
    policy = graph_bucket_policy(_config(max_num_seqs=4, max_num_batched_tokens=16), mode="FULL")
    ex = StaticGraphExecutor(torch.nn.Identity(), SimGraphAPI(), max_num_seqs=4, mode="FULL", length_adaptive=True)
    plan = ex.capture_plan(policy)
    assert plan == [("mixed", 16, 4), ("mixed", 8, 4), ("mixed", 4, 4), ("decode", 4, 4), ("mixed", 2, 2),
                    ("decode", 2, 2), ("decode", 1, 1)]
    assert ex.pool_reserve_bytes(1000.0, policy) == 16 * 1000 + 7 * (2 << 20)
    fdo = StaticGraphExecutor(torch.nn.Identity(), SimGraphAPI(), max_num_seqs=4, length_adaptive=True)
    assert [k for k, *_ in fdo.capture_plan(policy)] == ["decode"] * 3
