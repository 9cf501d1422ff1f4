"""The engine in its own process: what only a process can do wrong. It dies
(every pending request fails, health turns bad, nothing hangs, no process is
left), its frontend dies (it exits by itself), it cannot start (the error says
why), and a request that cannot cross the process boundary
fails alone."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from polyrunner import SamplingParams
from polyrunner.engine.async_llm import AsyncLLM, EngineDeadError
from polyrunner.engine.engine_process import EngineProcessError
from processes import children, gone


def _prompt(i: int, length: int = 12) -> dict:
    return {"prompt_token_ids": [1] + [(37 * i + 11 * j) % 500 + 3 for j in range(length - 1)]}


def _sp(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _new(folder) -> AsyncLLM:
    return AsyncLLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                    engine_process=True)



@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("llama")[0]


def double_logits(token_ids, logits):   # module level: it pickles by reference
    return logits * 2.0


def test_killed_engine_fails_every_pending_request(folder):
    a = _new(folder)
    pid = a._core.process.pid

    async def main():
        tasks = [asyncio.create_task(_collect(a, _prompt(i), _sp(10_000))) for i in range(3)]
        while a.num_running < 3:
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        with pytest.raises(EngineDeadError, match="exit code -9"):
            await _collect(a, _prompt(0), _sp())
        return results, time.monotonic() - t0

    results, elapsed = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "exited unexpectedly (exit code -9)" in str(results[0])
    assert elapsed < 30 and not a.is_healthy
    with pytest.raises(EngineDeadError):
        a.check_health()
    a.shutdown(5)
    assert not a._core.process.is_alive()


def test_engine_exits_when_its_frontend_dies(folder):
    script = textwrap.dedent(f"""
        import asyncio, os
        from polyrunner import SamplingParams
        from polyrunner.engine.async_llm import AsyncLLM
        a = AsyncLLM({str(folder)!r}, backend="cpu", dtype="float32", engine_process=True)
        async def main():
            a.add_request({{"prompt_token_ids": [1, 5, 6]}}, SamplingParams(max_tokens=100000, ignore_eos=True))
            while a.num_running < 1:
                await asyncio.sleep(0.01)
        asyncio.run(main())
        print(a._core.process.pid, flush=True)
        os._exit(0)   # no shutdown, no atexit: the frontend just vanishes
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    assert gone(pid, 20), f"engine process {pid} outlived its frontend"


def test_a_failed_start_says_why_and_leaves_no_process(tmp_path):
    before = children()
    with pytest.raises(EngineProcessError, match="failed to start.*does-not-exist"):
        AsyncLLM(str(tmp_path / "does-not-exist"), backend="cpu", engine_process=True)
    assert children() <= before


def test_logits_processors_cross_the_boundary_or_fail_alone(folder):
    a = _new(folder)
    try:
        async def main():
            with pytest.raises(ValueError, match="logits_processors must be picklable"):
                a.add_request(_prompt(2), _sp(logits_processors=[lambda ids, logits: logits]))
            return await _collect(a, _prompt(2), _sp(4, logits_processors=[double_logits]))

        outs = asyncio.run(main())
        assert len(outs[-1].outputs[0].token_ids) == 4 and a.is_healthy
    finally:
        a.shutdown(0)


async def _collect(a: AsyncLLM, prompt, params) -> list:
    return [out async for out in a.generate(prompt, params)]
