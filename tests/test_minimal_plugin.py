"""The minimal plugin of docs/plugins.md (examples/minimal_plugin.py): nothing
installed, registered at run time, it passes the whole conformance suite; it
imports nothing from polyrunner but `polyrunner.plugin_api`, which exports
every name it promises."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from polyrunner.plugins import register
from polyrunner.plugins.manager import unregister
from polyrunner.tools.conformance import format_report, run_conformance

PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "minimal_plugin.py"


@pytest.fixture(scope="module")
def minimal_cpu():
    spec = importlib.util.spec_from_file_location("minimal_plugin", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    register(module, name="minimal_plugin")
    try:
        yield "minimal_cpu"
    finally:
        unregister("minimal_plugin")


def test_minimal_plugin_passes_conformance(minimal_cpu):
    report = run_conformance(minimal_cpu)
    assert report.passed, format_report(report, verbose=True)
    for r in report.results:   # a skip only where a declared capability excuses it
        assert r.outcome == "passed" or (r.outcome == "skipped" and r.excused_by), (r.id, r.outcome, r.detail)
    assert report.get("execution::no_new_graphs_after_warmup").outcome == "passed"  # it counts its graphs
    assert report.get("registration::discovered").detail.endswith("via run-time plugin 'minimal_plugin'")


def test_minimal_plugin_imports_only_the_plugin_api():
    tree = ast.parse(PLUGIN.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m for m in imported if m.split(".")[0] == "polyrunner"} == {"polyrunner.plugin_api"}
    assert {m.split(".")[0] for m in imported} <= {"polyrunner", "torch", "numpy"} | sys.stdlib_module_names
    assert len(PLUGIN.read_text().splitlines()) <= 70   # a page (imports one per line, as ruff's isort writes them)


def test_plugin_api_exports_what_it_lists():
    import polyrunner.plugin_api as api
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing
    for name in ("hookimpl", "register", "Backend", "GraphExecutor", "Capabilities", "Availability", "HostFuture",
                 "ModelInputs", "BucketPolicy", "capture_sizes", "exponential_sizes", "gap_incremental_sizes",
                 "KVCacheSpec", "AttentionMetadata", "LayerSpec", "NULL_BLOCK", "NULL_SLOT",
                 "reference_paged_attention", "SAMPLING_FEATURES", "StaticGraphExecutor", "TorchGraphAPI",
                 "graph_bucket_policy", "profiled_kv_budget", "pinned_upload", "async_to_host"):
        assert name in api.__all__, name


def test_guide_shows_the_plugin_as_it_is():
    guide = (PLUGIN.parents[1] / "docs" / "plugins.md").read_text()
    assert f"```python\n{PLUGIN.read_text()}```" in guide
