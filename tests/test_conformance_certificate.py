"""The conformance report as a certificate: what it records about the software and
host it ran on (certificate.py), and the prerequisite declarations between checks."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
from pathlib import Path

import pytest
import torch

from polyrunner.tools.conformance.certificate import (
    ISA_FLAGS,
    SCHEMA_VERSION,
    collect_environment,
    cpu_info,
    device_libraries,
)
from polyrunner.tools.conformance.framework import (
    GROUPS,
    Check,
    CheckResult,
    Report,
    _validate_prerequisites,
    all_checks,
    blocked_by,
)

ROOT = Path(__file__).resolve().parents[1]

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse4_1 sse4_2 avx avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16 amx_int8 amx_tile hypervisor

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse4_1
"""
ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimddp sve i8mm bf16
CPU implementer\t: 0x41
"""


def test_cpu_info_reads_isa_flags_from_cpuinfo(tmp_path):
    (tmp_path / "x86").write_text(X86)
    (tmp_path / "arm").write_text(ARM)
    model, flags = cpu_info(str(tmp_path / "x86"))
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert flags == ["sse4_1", "sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni",
                     "amx_tile", "amx_bf16", "amx_int8"]   # ISA_FLAGS order; fpu, vme, hypervisor left out
    assert cpu_info(str(tmp_path / "arm"))[1] == ["asimd", "asimdhp", "asimddp", "fphp", "bf16", "i8mm", "sve"]
    assert cpu_info(str(tmp_path / "missing")) == ("", [])
    assert set(flags) <= set(ISA_FLAGS)


class _Declares:
    device_libraries = ("numpy", "not-a-real-distribution-xyz", "torch")


def test_device_libraries_declared_by_the_backend_win():
    libs = device_libraries(_Declares, "anything", "polyrunner")
    assert [(lib.distribution, lib.version) for lib in libs] == [
        ("numpy", importlib.metadata.version("numpy")), ("not-a-real-distribution-xyz", None)]  # torch: in versions


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_device_libraries_default_to_the_extra_named_after_the_backend():
    """Built-ins declare nothing: the plugin distribution's extra named after the backend
    names them (polyrunner[xla] -> torch_xla), installed or not."""
    from packaging.requirements import Requirement  # a dependency of pytest
    requires = [Requirement(r) for r in importlib.metadata.requires("polyrunner") or []]
    for backend in ("xla", "npu", "cuda"):
        want = [r.name for r in requires if r.marker is not None and f'extra == "{backend}"' in str(r.marker)
                and r.marker.evaluate({"extra": backend}) and r.name != "torch"]
        got = device_libraries(object, backend, "polyrunner")
        assert [lib.distribution for lib in got] == want, (backend, got)
        assert all(lib.version == _installed(lib.distribution) for lib in got)
    assert any(device_libraries(object, b, "polyrunner") for b in ("xla", "npu", "cuda"))
    assert device_libraries(object, "cpu", "polyrunner") == []
    assert device_libraries(object, "cpu", None) == []


def test_environment_of_the_cpu_backend():
    env = collect_environment("cpu", ["polyrunner", "conformance", "--backend", "cpu"])
    assert env.command == "polyrunner conformance --backend cpu"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", env.date)
    assert env.versions == {"polyrunner": importlib.metadata.version("polyrunner"), "torch": torch.__version__,
                            "python": platform.python_version()}
    assert env.plugin.backend_class == "polyrunner.backends.cpu.plugin.CPUBackend"
    assert (env.plugin.distribution, env.plugin.version) == ("polyrunner", importlib.metadata.version("polyrunner"))
    assert env.plugin.registered_via == "entry point cpu = polyrunner.backends.cpu.plugin"
    assert env.device.startswith("cpu")
    assert env.host.machine == platform.machine() and isinstance(env.host.cpu_flags, list)
    if Path("/proc/cpuinfo").exists():
        assert env.host.cpu_flags == cpu_info()[1]


def test_environment_of_an_unknown_backend_is_still_written():
    env = collect_environment("no_such_backend", "x")
    assert env.plugin.distribution is None and env.device == "" and env.versions["torch"] == torch.__version__


def test_report_json_carries_the_documented_fields():
    """Every top-level key and environment field is documented in the README's
    conformance section, and the report serialises to JSON."""
    report = Report("cpu", [CheckResult("buckets", "x", "blocked", "blocked by buckets::y", blocked_by=["buckets::y"])],
                    environment=collect_environment("cpu", "polyrunner conformance --backend cpu"))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema_version"] == SCHEMA_VERSION and data["passed"] is False
    assert data["summary"] == {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "blocked": 1}
    assert data["results"][0]["blocked_by"] == ["buckets::y"]
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### The conformance certificate"):]
    keys = set(data) | {f"plugin.{k}" for k in data["plugin"]} | {f"host.{k}" for k in data["host"]}
    missing = [k for k in keys if f"`{k}`" not in section]
    assert not missing, f"README's conformance section does not document {missing}"


def test_prerequisites_name_earlier_checks():
    checks = all_checks()   # validates every declaration
    ids = [c.id for c in checks]
    for i, c in enumerate(checks):
        for p in c.prerequisites:
            assert p in GROUPS or ids.index(p) < i, (c.id, p)
    assert checks[ids.index("end_to_end::greedy_matches_cpu_reference")].depends_on
    noop = checks[0].func
    with pytest.raises(ValueError, match="runs after it"):
        _validate_prerequisites([Check("buckets", "a", noop, depends_on=("buckets::b",)), Check("buckets", "b", noop)])
    with pytest.raises(ValueError, match="neither a check id nor a group"):
        _validate_prerequisites([Check("buckets", "a", noop, depends_on=("buckets::nope",))])
    with pytest.raises(ValueError, match="does not run before it"):
        _validate_prerequisites([Check("buckets", "a", noop, depends_on=("hygiene",))])


def test_blocked_by_names_the_root_failure():
    noop = all_checks()[0].func
    results = {"buckets::a": CheckResult("buckets", "a", "failed", "bad"),
               "buckets::b": CheckResult("buckets", "b", "blocked", blocked_by=["buckets::a"]),
               "buckets::c": CheckResult("buckets", "c", "skipped"),
               "kv_cache::d": CheckResult("kv_cache", "d", "error", "boom")}
    assert blocked_by(Check("kv_cache", "x", noop, depends_on=("buckets::b",)), results) == ["buckets::a"]
    assert blocked_by(Check("kv_cache", "x", noop, depends_on=("buckets::c",)), results) == []   # skipped: no block
    assert blocked_by(Check("kv_cache", "x", noop, depends_on=("buckets::zzz",)), results) == []  # not selected
    assert blocked_by(Check("execution", "x", noop, depends_on=("buckets", "kv_cache::d")), results) == \
        ["buckets::a", "kv_cache::d"]
    results["registration::available_here"] = CheckResult("registration", "available_here", "failed")
    assert blocked_by(Check("execution", "x", noop), results) == ["registration::available_here"]  # implicit
