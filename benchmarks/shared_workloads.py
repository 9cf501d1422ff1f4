"""The benchmark workloads, loaded by file path: for scripts that run in a
foreign runner's venv (vLLM, llama.cpp), where polyrunner is not installed.
`core/tools/bench/workloads.py` needs only numpy."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def workloads() -> ModuleType:
    """polyrunner.tools.bench.workloads, loaded from the source tree."""
    spec = importlib.util.spec_from_file_location("_pr_workloads", ROOT / "core" / "tools" / "bench" / "workloads.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_pr_workloads"] = mod
    spec.loader.exec_module(mod)
    return mod
