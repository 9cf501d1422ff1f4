"""AsyncLLM serving concurrent async callers — streaming, abort, a bad request
failing alone, a dead loop failing every pending request, graceful shutdown,
timings — with the engine in a thread and in its own process (the process's
own failure modes are in test_engine_process.py)."""

import asyncio
import os
import threading
import time

import pytest

from polyrunner import LLM, SamplingParams
from polyrunner.engine.async_llm import AsyncLLM, EngineDeadError, EngineNotAcceptingError


def _prompt(i: int, length: int = 12) -> dict:
    return {"prompt_token_ids": [1] + [(37 * i + 11 * j) % 500 + 3 for j in range(length - 1)]}


def _sp(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _new(folder, **kw) -> AsyncLLM:
    kw = {"backend": "cpu", "dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64, **kw}
    return AsyncLLM(str(folder), **kw)


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("llama")[0]


@pytest.fixture(scope="module", params=["thread", "process"])
def allm(folder, request):
    a = _new(folder, engine_process=request.param == "process")
    yield a
    a.shutdown(0)


def wait_idle(a: AsyncLLM, timeout: float = 10.0) -> None:
    """Wait for the engine to run out of work, then check nothing is left (its own
    counts; in a thread, its internals too)."""
    deadline = time.monotonic() + timeout
    while (a.num_requests or not a.counts.idle) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.num_requests == 0 and a.num_waiting == 0 and a.num_running == 0
    assert a.counts.idle, a.counts
    if not a.engine_process:
        eng = a.engine
        time.sleep(0.05)
        assert not eng.has_unfinished_requests()
        assert not eng.scheduler.running and not eng.scheduler.waiting
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_usable_blocks
        assert eng.runner.states.num_active == 0
        assert not eng.outputs._parents


async def _collect(a: AsyncLLM, prompt, params, rid=None) -> list:
    return [out async for out in a.generate(prompt, params, rid)]


def test_concurrent_generate_streams_and_matches_llm_generate(allm, folder):
    prompts = [_prompt(i) for i in range(6)]
    params = [_sp(6 + i) for i in range(6)]

    async def main():
        # the same admission (one step) as LLM.generate: the same batches, the same tokens
        with allm.batch():
            streams = [allm.add_request(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        async def drain(stream):
            return [o async for o in stream]
        return await asyncio.gather(*(drain(s) for s in streams))

    got = asyncio.run(main())
    ref = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
    expected = ref.generate(prompts, params, use_tqdm=False)
    for outs, exp, sp in zip(got, expected, params):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == sorted(counts) and counts[-1] == sp.max_tokens
        assert outs[-1].outputs[0].token_ids == exp.outputs[0].token_ids
        assert outs[-1].outputs[0].finish_reason == "length"
    wait_idle(allm)


def test_many_callers_with_random_arrival(allm):
    async def one(i):
        await asyncio.sleep(0.002 * (i % 7))
        outs = await _collect(allm, _prompt(i, 5 + i % 9), _sp(3 + i % 5))
        return outs[-1]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(40)))

    finals = asyncio.run(main())
    assert [len(f.outputs[0].token_ids) for f in finals] == [3 + i % 5 for i in range(40)]
    wait_idle(allm)


def test_abort_frees_blocks_and_ends_the_stream(allm):
    async def main():
        outs = []
        async for out in allm.generate(_prompt(1), _sp(400), "long"):
            outs.append(out)
            if len(outs) == 3:
                assert allm.counts.kv_free_blocks < allm.counts.kv_usable_blocks
                allm.abort("long")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 400
    wait_idle(allm)


def test_leaving_the_iteration_early_aborts(allm):
    async def main():
        gen = allm.generate(_prompt(2), _sp(400), "left")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()

    asyncio.run(main())
    wait_idle(allm)


def test_cancelled_caller_aborts(allm):
    async def main():
        task = asyncio.create_task(_collect(allm, _prompt(3), _sp(400), "cancelled"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_idle(allm)


def test_a_bad_request_fails_alone(allm):
    async def main():
        good = asyncio.create_task(_collect(allm, _prompt(4), _sp(10)))
        bad = [asyncio.create_task(_collect(allm, p, sp)) for p, sp in [
            ({"prompt_token_ids": [1, 99999]}, _sp()),                     # out of vocabulary
            ("text without a tokenizer", _sp()),                            # the tiny model has none
            (_prompt(5), _sp(stop_token_ids=[10_000])),                     # stop id out of vocabulary
            ({"prompt_token_ids": []}, _sp()),
        ]]
        results = await asyncio.gather(*bad, return_exceptions=True)
        return await good, results

    good, results = asyncio.run(main())
    assert len(good[-1].outputs[0].token_ids) == 10
    assert all(isinstance(r, ValueError) for r in results), results
    assert "99999" in str(results[0]) and "tokenizer" in str(results[1]) and "stop_token_ids" in str(results[2])
    assert allm.is_healthy
    wait_idle(allm)


def test_duplicate_request_id_is_refused(allm):
    async def main():
        gen = allm.generate(_prompt(6), _sp(50), "dup")
        await anext(gen)
        with pytest.raises(ValueError, match="already in use"):
            await _collect(allm, _prompt(7), _sp(), "dup")
        await gen.aclose()

    asyncio.run(main())
    wait_idle(allm)


def test_idle_loop_sleeps(allm):
    wait_idle(allm)
    if allm.engine_process:   # the engine process burns (almost) no CPU while idle
        pid = allm._core.process.pid
        before = _cpu_seconds(pid)
        time.sleep(0.5)
        assert _cpu_seconds(pid) - before < 0.05
        return
    calls = []
    original = allm.engine.has_unfinished_requests
    allm.engine.has_unfinished_requests = lambda: calls.append(1) or original()
    try:
        time.sleep(0.3)
        assert len(calls) <= 1   # woken at most once, not spinning
    finally:
        del allm.engine.has_unfinished_requests


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_timings_and_stats(allm):
    seen = []
    allm.add_stats_listener(seen.append)
    try:
        async def main():
            stream = allm.add_request(_prompt(8), _sp(5), "timed")
            outs = [o async for o in stream]
            assert outs[-1].finished
            return stream.timings

        t = asyncio.run(main())
    finally:
        allm.remove_stats_listener(seen.append)
    assert t.num_prompt_tokens == 12 and t.num_generation_tokens == 5 and t.finish_reason == "length"
    assert t.arrival_time <= t.first_token_time <= t.finished_time
    assert len(t.token_times) == 5 and len(t.inter_token_latencies) == 4
    assert 0 <= t.time_to_first_token <= t.e2e_latency
    assert sum(s.num_generation_tokens for s in seen) == 5
    assert sum(s.num_prompt_tokens for s in seen) == 12
    assert len([x for s in seen for x in s.time_to_first_token]) == 1
    assert len([x for s in seen for x in s.inter_token_latency]) == 4
    assert [f.finish_reason for s in seen for f in s.finished] == ["length"]


def test_dead_loop_fails_every_pending_request(folder):
    a = _new(folder)
    real_step = a.engine.step
    steps = []

    def failing_step():
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("injected device failure")
        return real_step()

    a.engine.step = failing_step

    async def main():
        tasks = [asyncio.create_task(_collect(a, _prompt(i), _sp(50))) for i in range(5)]
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        with pytest.raises(EngineDeadError, match="injected device failure"):
            await _collect(a, _prompt(9), _sp())
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "injected device failure" in str(results[0])
    assert not a.is_healthy
    with pytest.raises(EngineDeadError):
        a.check_health()
    t0 = time.monotonic()
    a.shutdown(5)
    assert time.monotonic() - t0 < 1


def test_graceful_shutdown_drains_then_refuses(folder):
    a = _new(folder)

    async def main():
        tasks = [asyncio.create_task(_collect(a, _prompt(i), _sp(30))) for i in range(4)]
        await asyncio.sleep(0.02)
        await a.shutdown_async(timeout=30)
        with pytest.raises(EngineNotAcceptingError):
            await _collect(a, _prompt(0), _sp())
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert [r[-1].outputs[0].finish_reason for r in results] == ["length"] * 4
    assert [len(r[-1].outputs[0].token_ids) for r in results] == [30] * 4
    assert not a._core.alive


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_shutdown_timeout_aborts_the_rest(folder, process):
    a = _new(folder, engine_process=process)
    if not process:   # a process's engine cannot be slowed from here; 512 tokens take it far over 0.05 s
        slow = a.engine.step
        a.engine.step = lambda: (time.sleep(0.01), slow())[1]

    async def main():
        task = asyncio.create_task(_collect(a, _prompt(1), _sp(10_000)))   # up to max_model_len (512)
        while a.num_running < 1:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await a.shutdown_async(timeout=0.05)
        assert time.monotonic() - t0 < 10
        return await asyncio.wait_for(task, 5)

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 500
    assert a.counts.idle, a.counts          # the engine's last report: every block free, no runner state
    if process:
        assert not a._core.process.is_alive() and a._core.process.exitcode == 0   # reaped


def test_outputs_reach_several_event_loops(allm):
    results = {}

    def worker(k):
        async def main():
            return await _collect(allm, _prompt(k), _sp(7))
        results[k] = asyncio.run(main())[-1]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(results) == [0, 1, 2]
    assert all(len(r.outputs[0].token_ids) == 7 for r in results.values())
    wait_idle(allm)
