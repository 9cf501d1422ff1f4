"""Tensor parallelism on the CPU backend (gloo): tensor_parallel_size=2 gives the
greedy tokens of 1 (logprobs within 1e-4) on every model family, with chunked
prefill, forced preemption and a single KV head; a killed worker fails the call
naming its rank, and no process is left; ranks started torchrun-style
(env:// rendezvous, two processes over loopback) agree too."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from polyrunner import LLM, SamplingParams
from polyrunner.distributed.shard import TPShard
from polyrunner.distributed.workers import TensorParallelError
from polyrunner.models.arch import DecoderArch
from processes import children
from tiny_models import COMMON

PROMPTS = [[1, 5, 9, 200, 31, 7], [1, 44, 3, 8] * 9, [1, 300, 301, 302, 17, 99, 23, 5, 6, 7, 8], [1, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


def _llm(folder, tp: int, **kw) -> LLM:
    return LLM(str(folder), backend="cpu", dtype="float32", tensor_parallel_size=tp, max_num_seqs=8, **kw)


def _run(folder, tp: int, **kw):
    llm = _llm(folder, tp, **kw)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def _assert_same(got, expected) -> None:
    for g, e in zip(got, expected):
        go, eo = g.outputs[0], e.outputs[0]
        assert go.token_ids == eo.token_ids
        for gp, ep in zip(go.logprobs, eo.logprobs):
            assert gp.keys() == ep.keys()
            for tid in ep:
                assert abs(gp[tid].logprob - ep[tid].logprob) < 1e-4


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    cache = {}

    def get(kind: str, **kw):
        key = (kind, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = _run(tiny_model_factory(kind)[0], 1, **kw)
        return cache[key]
    return get


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "llama_mqa", "llama_odd", "phi3"])
def test_tp2_equals_tp1(kind, tiny_model_factory, reference):
    folder = tiny_model_factory(kind)[0]
    _assert_same(_run(folder, 2), reference(kind))


def test_tp2_equals_tp1_with_chunked_prefill_and_preemption(tiny_model_factory, reference):
    folder = tiny_model_factory("llama")[0]
    kw = dict(max_num_batched_tokens=16, num_gpu_blocks_override=6)   # the same blocks on every rank
    expected = reference("llama", **kw)
    llm = _llm(folder, 2, **kw)
    try:
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    _assert_same(got, expected)


def test_prompt_logprobs_and_speculative_decoding_tp2_equal_tp1(tiny_model_factory):
    """The workers verify the same draft tokens, and prompt logprobs cover the whole vocabulary."""
    folder = tiny_model_factory("llama")[0]
    repetitive = [{"prompt_token_ids": p} for p in ([1] + [7, 8, 9, 10, 11] * 6, [1, 5, 9, 200, 31, 7] * 4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)   # drafted (no logprobs)
    prompt_lps = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    drafted, scored, accepted = {}, {}, {}
    for tp in (1, 2):
        llm = _llm(folder, tp, speculative_config=spec)
        try:
            drafted[tp] = [o.outputs[0].token_ids for o in llm.generate(repetitive, greedy, use_tqdm=False)]
            accepted[tp] = llm.engine.speculative_stats().num_accepted_tokens
            scored[tp] = llm.generate(repetitive, prompt_lps, use_tqdm=False)
        finally:
            llm.shutdown()
    assert drafted[2] == drafted[1] and accepted[2] == accepted[1] > 0
    for g, e in zip(scored[2], scored[1]):
        for gp, ep in zip(g.prompt_logprobs[1:], e.prompt_logprobs[1:]):
            assert gp.keys() == ep.keys()
            assert all(abs(gp[t].logprob - ep[t].logprob) < 1e-4 for t in ep)


def test_embedded_smollm2_tp2_equals_tp1():
    """SmolLM2-135M: 9 heads over 3 KV heads, padded with a zero KV head on 2 ranks."""
    pytest.importorskip("gguf")
    prompts = [{"prompt_token_ids": p} for p in ([1, 504, 3458, 314, 4649, 282], [1, 4093, 2114, 253, 655])]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = {}
    for tp in (1, 2):
        llm = LLM(None, backend="cpu", dtype="float32", tensor_parallel_size=tp, max_model_len=256, max_num_seqs=4)
        try:
            outs[tp] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
    _assert_same(outs[2], outs[1])


def test_shards_split_heads_and_replicate_a_single_kv_head():
    arch = DecoderArch.from_hf_config({**COMMON, "num_key_value_heads": 1, "vocab_size": 511})
    shards = [TPShard.of(arch, r, 2) for r in range(2)]
    assert [(s.num_heads, s.q_head_start, s.num_kv_heads, s.kv_head_start) for s in shards] == [
        (2, 0, 1, 0), (2, 2, 1, 0)]
    w = torch.arange(511 * 3.0).view(511, 3)
    rows = [s.slice("embed_tokens.weight", w) for s in shards]
    assert [r.shape[0] for r in rows] == [256, 256] and torch.equal(torch.cat(rows)[:511], w)
    assert not rows[1][-1].any()   # the padding row past the vocabulary
    with pytest.raises(ValueError, match=r"intermediate_size \(128\) must be divisible by tensor parallel size \(3\)"):
        TPShard.of(arch, 0, 3)
    # SmolLM2's 9 heads over 3 KV heads on 2 ranks: a zero KV head (and its 3 q heads) is added
    smol = DecoderArch.from_hf_config({**COMMON, "num_attention_heads": 9, "num_key_value_heads": 3,
                                       "hidden_size": 576})
    a, b = (TPShard.of(smol, r, 2) for r in range(2))
    assert (a.num_heads, a.num_kv_heads, b.q_head_start, b.kv_head_start) == (6, 2, 6, 2)
    q = torch.randn(9 * 64, 576)
    assert torch.equal(b.slice("q_proj.weight", q)[:3 * 64], q[6 * 64:]) and not b.slice("q_proj.weight", q)[192:].any()


def test_a_killed_worker_fails_the_call_naming_its_rank(tiny_model_factory):
    folder = tiny_model_factory("llama")[0]
    llm = _llm(folder, 2)
    worker = llm.engine.tp_driver.workers.processes[1]
    kill_during_generate(llm, lambda: os.kill(worker.pid, signal.SIGKILL), r"rank 1 died \(exit code -9\)")
    assert not worker.is_alive() and not children()


def kill_during_generate(llm: LLM, kill, match: str) -> None:
    """Run long generates on `llm` while `kill()` fires after 1 s: the call fails within
    30 s with a TensorParallelError matching `match`; `llm` is shut down either way."""
    timer = threading.Timer(1.0, kill)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(TensorParallelError, match=match):
            for _ in range(200):   # until the kill lands
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], long, use_tqdm=False)
        assert time.monotonic() - t0 < 30
    finally:
        timer.cancel()
        llm.shutdown()


def test_torchrun_style_ranks_over_loopback(tiny_model_factory, reference):
    folder = tiny_model_factory("qwen2")[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = textwrap.dedent(f"""
        import json
        from polyrunner import LLM, SamplingParams
        llm = LLM({str(folder)!r}, backend="cpu", dtype="float32", tensor_parallel_size=2, max_num_seqs=8)
        outs = llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}],
                            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        print(json.dumps([o.outputs[0].token_ids for o in outs]))
        llm.shutdown()
    """)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    import json
    tokens = json.loads(outs[0][0].strip().splitlines()[-1])
    assert tokens == [o.outputs[0].token_ids for o in reference("qwen2")]
    assert outs[1][0].strip() == ""   # rank 1 served steps; the caller's code after LLM(...) ran on rank 0 only




def test_an_engine_process_runs_tensor_parallel_and_leaves_nothing(tiny_model_factory, reference):
    """`polyrunner serve --tensor-parallel-size 2`: the engine process starts its own worker."""
    import asyncio

    from polyrunner.engine.async_llm import AsyncLLM
    folder = tiny_model_factory("mistral")[0]
    before = children()
    a = AsyncLLM(str(folder), backend="cpu", dtype="float32", tensor_parallel_size=2, max_num_seqs=8,
                 engine_process=True)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def main():
        with a.batch():
            streams = [a.add_request({"prompt_token_ids": p}, sp) for p in PROMPTS]
        finals = []
        for s in streams:
            finals.append([o async for o in s][-1])
        return finals

    try:
        finals = asyncio.run(main())
    finally:
        a.shutdown(0)
    assert [f.outputs[0].token_ids for f in finals] == [o.outputs[0].token_ids for o in reference("mistral")]
    assert children() <= before
