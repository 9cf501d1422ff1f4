"""The example device plugin (examples/custom_device_plugin) passes the whole
conformance suite, registered at run time (or through its entry point when
it is pip-installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from polyrunner.plugins import register
from polyrunner.plugins.manager import backend_classes, unregister
from polyrunner.tools.conformance import format_report, run_conformance

SRC = Path(__file__).resolve().parents[1] / "examples" / "custom_device_plugin" / "src"


@pytest.fixture(scope="module")
def cpu_paged():
    if "cpu_paged" in backend_classes():   # installed: the entry point already registers it
        yield "cpu_paged"
        return
    sys.path.insert(0, str(SRC))
    import polyrunner_cpu_paged.plugin as plugin
    register(plugin, name="polyrunner_cpu_paged.plugin")
    try:
        yield "cpu_paged"
    finally:
        unregister("polyrunner_cpu_paged.plugin")
        sys.path.remove(str(SRC))


def test_example_plugin_passes_conformance(cpu_paged):
    report = run_conformance(cpu_paged)
    assert report.passed, format_report(report, verbose=True)
    # excused by capabilities (a check needing an optional package that is not installed skips too):
    # it declares counts_graphs, its attention has no soft cap, its copies block, and its static shapes
    # have no bucket for verification steps
    skipped = [r for r in report.results if r.outcome == "skipped" and not r.package_missing]
    assert [r.excused_by for r in skipped] == ["capabilities.attention_features lacks 'logits_soft_cap'",
                                               "capabilities.async_scheduling=False",
                                               "capabilities.static_shapes=True"]
    # the certificate names the plugin's own distribution (none when registered from a source folder)
    plugin = report.to_dict()["plugin"]
    assert plugin["backend_class"] == "polyrunner_cpu_paged.plugin.CPUPagedBackend"
    if plugin["registered_via"].startswith("entry point"):
        from importlib.metadata import version
        assert (plugin["distribution"], plugin["version"]) == ("polyrunner-cpu-paged", version("polyrunner-cpu-paged"))
    else:
        assert plugin["registered_via"] == "run-time plugin polyrunner_cpu_paged.plugin"


def test_example_kv_layout_is_heads_major(cpu_paged):
    import torch

    from polyrunner.device.kv_spec import KVCacheSpec
    from polyrunner_cpu_paged import kv_layout
    spec = KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=3, head_size=8, dtype=torch.float32)
    (kv,) = kv_layout.allocate(spec, num_blocks=5)
    assert tuple(kv.shape) == spec.layer_shape(5)
    phys = kv_layout.physical(kv)
    assert phys.is_contiguous() and tuple(phys.shape) == (2, 3, 5, 4, 8)
    assert kv.data_ptr() % kv_layout.ALIGNMENT == 0
