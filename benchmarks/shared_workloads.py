"""The benchmark workloads, loaded by file path: for scripts that run in a
foreign runner's venv (vLLM, llama.cpp), where polyrunner is not installed.
`core/tools/bench/workloads.py` needs only numpy.

Also what every worker does with a workload alike: `capped` (smoke runs) and `result` (the fields of
a `RESULT` line, derived as polyrunner's own `tools/bench/run.py: run_workload` derives them)."""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def workloads() -> ModuleType:
    """polyrunner.tools.bench.workloads, loaded from the source tree."""
    spec = importlib.util.spec_from_file_location("_pr_workloads", ROOT / "core" / "tools" / "bench" / "workloads.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_pr_workloads"] = mod
    spec.loader.exec_module(mod)
    return mod


def capped(w: Any, max_tokens: int | None) -> Any:
    """Workload `w` with every request's output capped at `max_tokens` (smoke runs); `w` itself for None."""
    return dataclasses.replace(w, max_tokens=min(w.max_tokens, max_tokens)) if max_tokens else w


def result(runner: str, w: Any, walls: list[float], ttfts: list[float], output_tokens: int,
           **extra: Any) -> dict[str, Any]:
    """A worker's `RESULT` fields for workload `w`: the median of the timed runs' `walls`, output and
    total tok/s; W2's mean time per output token (wall / max_tokens); W3's TTFT (median of `ttfts`, the
    1-token runs or the first tokens' times) and time per output token ((wall - TTFT) / (max_tokens - 1))."""
    wall = statistics.median(walls)
    res = dict(runner=runner, workload=w.name, wall_s=wall, walls=walls, output_tokens=output_tokens,
               prompt_tokens=w.prompt_tokens, output_tok_s=output_tokens / wall,
               total_tok_s=(output_tokens + w.prompt_tokens) / wall, **extra)
    if w.name == "w2":
        res["tpot_ms"] = wall / w.max_tokens * 1e3
    if w.name == "w3":
        ttft = statistics.median(ttfts)
        res["ttft_ms"] = ttft * 1e3
        res["tpot_ms"] = (wall - ttft) / (w.max_tokens - 1) * 1e3
    return res
