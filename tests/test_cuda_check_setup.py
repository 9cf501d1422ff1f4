"""benchmarks/cuda_check.py's set-up (cuda_check_setup.py) makes polyrunner importable from the
tree without installing it, names what is missing, and the script ends in one JSON summary
(its GPU phases skip with a reason on a machine without a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cuda_check_setup as setup  # noqa: E402


def test_linked_tree_imports_from_outside_with_its_entry_points(tmp_path):
    setup.link_tree(tmp_path)
    code = ("import polyrunner, polyrunner.backends.cuda.plugin as p, pathlib; "
            "print(pathlib.Path(polyrunner.__file__).resolve()); print(pathlib.Path(p.__file__).resolve())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}).stdout.split()
    assert out == [str(ROOT / "core" / "__init__.py"), str(ROOT / "backends" / "cuda" / "plugin.py")]
    (info,) = tmp_path.glob("polyrunner-*.dist-info")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["polyrunner.backends"]
    eps = {e.name: e.value for e in PathDistribution(info).entry_points if e.group == "polyrunner.backends"}
    assert eps == declared


def test_a_missing_module_is_named(monkeypatch):
    monkeypatch.setattr(setup, "REQUIRED", ("json", "polyrunner_no_such_module"))
    missing, _ = setup.check_imports()
    assert len(missing) == 1 and missing[0].startswith("polyrunner_no_such_module (ModuleNotFoundError")


def test_check_script_ends_in_a_json_summary_without_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run its GPU phases")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_check.py"), "--wheels", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and summary["setup"]["missing"] == []
    assert summary["env"]["backend"]["cpu"].startswith("cpu")
    assert summary["decode"] == {"skipped": "no CUDA device (torch.cuda.is_available() is False)"}
