"""Front-ends of the conformance suite: `polyrunner conformance` and the pytest plugin."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_cpu_backend_passes(tmp_path, capsys):
    """`polyrunner conformance --backend cpu`: exit 0, a table per group, the skipped
    checks listed with the capability that excused them."""
    from polyrunner.tools.cli import main
    from polyrunner.tools.conformance.framework import GROUPS
    report_file = tmp_path / "report.json"
    rc = main(["conformance", "--backend", "cpu", "--json", str(report_file)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for group in GROUPS:
        assert f"[{group}]" in out
    assert "PASSED:" in out
    assert "skipped (excused by declared capabilities):" in out
    assert "end_to_end::async_scheduling_same_tokens: capabilities.async_scheduling=False" in out
    assert re.search(r"no_new_graphs_after_warmup +PASS", out)   # the CPU backend counts its graphs
    data = json.loads(report_file.read_text())
    assert data["passed"] and data["backend"] == "cpu"
    assert {r["group"] for r in data["results"]} == set(GROUPS)
    # the certificate: what was tested where
    import torch

    from polyrunner.tools.conformance.certificate import SCHEMA_VERSION, cpu_info
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["versions"] == {"polyrunner": importlib.metadata.version("polyrunner"),
                                "torch": torch.__version__, "python": platform.python_version()}
    assert (data["plugin"]["distribution"] == "polyrunner"
            and data["plugin"]["module"] == "polyrunner.backends.cpu.plugin")
    assert data["device_libraries"] == [] and data["device"].startswith("cpu")
    assert data["host"]["cpu_flags"] == (cpu_info()[1] if sys.platform.startswith("linux") else [])
    assert data["date"].endswith("Z") and data["command"]
    assert data["summary"]["failed"] == data["summary"]["blocked"] == 0
    assert data["summary"]["passed"] + data["summary"]["skipped"] == len(data["results"])
    assert "polyrunner " in out.splitlines()[1] and "torch " in out.splitlines()[1]   # the header names versions


def test_cli_lists_checks(capsys):
    from polyrunner.tools.cli import main
    assert main(["conformance", "--backend", "cpu", "--list"]) == 0
    out = capsys.readouterr().out
    assert "buckets::pad_covers_every_legal_batch" in out
    assert "execution::no_new_graphs_after_warmup" in out and "requires counts_graphs" in out
    assert "end_to_end::structured_outputs" in out and "[needs xgrammar (polyrunner[structured])]" in out


def test_cli_unknown_backend_exits_nonzero(capsys):
    from polyrunner.tools.cli import main
    assert main(["conformance", "--backend", "no_such_backend", "--group", "registration"]) == 1
    assert "no plugin contributes a backend named 'no_such_backend'" in capsys.readouterr().out


def test_cli_subprocess_with_runtime_plugin():
    """The installed console script, registering the example plugin with --plugin."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "examples" / "custom_device_plugin" / "src"))
    exe = Path(sys.executable).with_name("polyrunner")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "polyrunner.tools.cli"]
    proc = subprocess.run(cmd + ["conformance", "--plugin", "polyrunner_cpu_paged.plugin", "--backend",
                                 "cpu_paged", "--group", "registration", "--group", "buckets", "--threads", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[registration]" in proc.stdout and "[buckets]" in proc.stdout and "PASSED:" in proc.stdout


def test_pytest_plugin_front_end(tmp_path):
    """`pytest -p polyrunner.tools.conformance.pytest_plugin --pyargs polyrunner.tools.conformance --backend cpu
    --junitxml FILE`: JUnit testcases named `polyrunner.conformance.<group>` / `<check>`, not by install path."""
    from polyrunner.tools.conformance.framework import select_checks
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "polyrunner.tools.conformance.pytest_plugin", "--pyargs",
         "polyrunner.tools.conformance", "--backend", "cpu", "--conformance-group", "registration",
         "--conformance-group", "buckets", "--conformance-threads", "1", "-q", "-p", "no:cacheprovider",
         "-rs", "--junitxml", str(tmp_path / "junit.xml")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(select_checks(['registration', 'buckets']))} passed" in proc.stdout
    assert "warning" not in proc.stdout.lower(), proc.stdout   # record_xml_attribute's warnings stay silent
    cases = [(c.get("classname"), c.get("name")) for c in ET.parse(tmp_path / "junit.xml").getroot().iter("testcase")]
    assert cases == [(f"polyrunner.conformance.{c.group}", c.name)
                     for c in select_checks(["registration", "buckets"])], cases


def test_pytest_plugin_reports_capability_skips(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "polyrunner.tools.conformance.pytest_plugin", "--pyargs",
         "polyrunner.tools.conformance", "--backend", "cpu", "--conformance-group", "end_to_end",
         "-k", "async_scheduling", "--conformance-threads", "1", "-q", "-p", "no:cacheprovider", "-rs"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "excused: capabilities.async_scheduling=False" in proc.stdout
