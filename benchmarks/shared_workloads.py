"""The benchmark workloads, loaded by file path: for scripts that run in a
foreign runner's venv (vLLM, llama.cpp), where polyrunner is not installed.
`core/tools/bench/workloads.py` needs only numpy.

Also what every worker does with a workload alike: `capped` (smoke runs) and `result` (the fields of
a `RESULT` line, by the workloads module's `result`, as polyrunner's own `run_workload` does)."""

from __future__ import annotations

import dataclasses
import importlib.util
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
    """`core/tools/bench/workloads.py: result`: the fields of a worker's `RESULT` line."""
    return workloads().result(runner, w, walls, ttfts, output_tokens, **extra)
