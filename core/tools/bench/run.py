"""Run the benchmark workloads on polyrunner (in this process) and cold start
(in a subprocess). Every timed run is repeated; results are medians."""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from polyrunner.tools.bench.workloads import Workload, make_workload, result

logger = logging.getLogger(__name__)

ENGINE_OPTIONS = dict(enable_prefix_caching=False, max_num_seqs=64,
                      max_num_batched_tokens=2048, seed=0)


def make_llm(model: str | None = None, enforce_eager: bool = False, **options):
    from polyrunner import LLM
    return LLM(model, backend="cpu", enforce_eager=enforce_eager, **{**ENGINE_OPTIONS, **options})


def _generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    from polyrunner import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return wall, sum(len(t) for t in tokens), tokens


class StepRecorder:
    """Records the token count of every model step the runner executes."""

    def __init__(self, llm) -> None:
        self.runner = llm.engine.runner
        self.steps: list[int] = []
        self._orig = self.runner.execute
        self._orig_async = self.runner.execute_async   # asynchronous scheduling queues steps here

    def __enter__(self) -> "StepRecorder":
        def execute(so):
            self.steps.append(so.total_num_tokens)
            return self._orig(so)

        def execute_async(so):
            self.steps.append(so.total_num_tokens)
            return self._orig_async(so)
        self.runner.execute, self.runner.execute_async = execute, execute_async
        return self

    def __exit__(self, *exc) -> None:
        self.runner.execute, self.runner.execute_async = self._orig, self._orig_async


def run_workload(llm, w: Workload, repeats: int = 3) -> dict[str, Any]:
    """Median wall time (and derived rates) of `w` over `repeats` runs."""
    _generate(llm, w.prompts[:4], 8)  # warm-up (kernels, allocator)
    walls, ttfts, steps, tokens, ntok = [], [], [], None, 0
    for _ in range(repeats):
        if w.name == "w3":
            ttfts.append(_generate(llm, w.prompts, 1)[0])
        with StepRecorder(llm) as rec:
            wall, ntok, tokens = _generate(llm, w.prompts, w.max_tokens)
        walls.append(wall)
        steps = rec.steps
    runner = "polyrunner" + ("-eager" if llm.engine.config.runner.enforce_eager else "")
    return result(runner, w, walls, ttfts, ntok, dtype=str(llm.engine.dtype).removeprefix("torch."),
                  step_tokens=steps, first_tokens=tokens[0][:16])


COLD_START_CHILD = r"""
import sys, time
from polyrunner import LLM, SamplingParams
llm = LLM(None, backend="cpu", enable_prefix_caching=False)
out = llm.generate([{"prompt_token_ids": list(range(100, 132))}],
                   SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 1
print("FIRST_TOKEN", flush=True)
"""


def cold_start(repeats: int = 3) -> dict[str, Any]:
    """Seconds from process start to the first generated token (embedded model,
    weights already converted and cached: one untimed run first)."""
    env = dict(os.environ, TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false")

    def once() -> float:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", COLD_START_CHILD], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
        elapsed = None
        for line in proc.stdout:
            if line.strip() == "FIRST_TOKEN":
                elapsed = time.perf_counter() - start
        err = proc.stderr.read()
        if proc.wait() != 0 or elapsed is None:
            raise RuntimeError(f"cold-start child failed: {err[-2000:]}")
        return elapsed

    once()  # caches: GGUF conversion, CPU kernel build
    runs = [once() for _ in range(repeats)]
    return dict(workload="coldstart", cold_start_s=statistics.median(runs), runs=runs)


def run_all_workloads(names: list[str], repeats: int, model: str | None = None,
                      enforce_eager: bool = False, **options) -> list[dict[str, Any]]:
    """`options`: more `LLM` arguments (e.g. dtype="bfloat16": a GGUF model dequantised).
    The timed runs start with the KV cache mapped (`map_kv_cache`)."""
    llm = make_llm(model, enforce_eager, **{"prefault_kv_cache": True, **options})
    map_kv_cache(llm)
    return [run_workload(llm, make_workload(n), repeats) for n in names]


def map_kv_cache(llm, timeout_s: float = 300.0) -> None:
    """Wait until the engine's KV cache is mapped (`prefault_kv_cache`), so that no timed run pays
    first-touch page faults: vLLM zero-fills its cache at start-up (`torch.zeros`), and a first
    touch costs ~2 s per GiB on this project's VMs, whose memory the host backs lazily (a
    mid-size W1 run touches ~0.6 GiB of cache; benchmarks/results/design-measurements.md).
    Cold start (`cold_start`) maps nothing up front, as `LLM()` by default does not."""
    backend = getattr(llm.engine.runner, "backend", None)
    start = time.perf_counter()
    if backend is not None and not backend.wait_kv_cache_mapped(timeout_s):
        raise RuntimeError(f"the KV cache was not mapped after {timeout_s:.0f} s")
    logger.info("KV cache mapped before the timed runs (waited %.1f s)", time.perf_counter() - start)


def kernel_report(model: str | None = None, enforce_eager: bool = False, **options) -> str:
    """The kernels the backend's executor chose for the model (`GraphExecutor.kernel_report`),
    measuring them first where this machine has no cached choice."""
    llm = make_llm(model, enforce_eager, **options)
    report = llm.engine.runner.executor.kernel_report()
    return report or "the backend's executor reports no kernel choices for this model"
