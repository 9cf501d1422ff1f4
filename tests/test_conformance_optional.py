"""Optional dependencies are optional in the conformance suite: a check whose
feature needs a package that is not installed is skipped, the reason naming
the package and the extra that installs it; the suite passes for the CPU
backend with every optional package hidden (`.ci/hide_packages`, also used by
`make test`)."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from polyrunner.tools.conformance.context import ConformanceContext
from polyrunner.tools.conformance.framework import GROUPS, PASSED, SKIPPED, Check, Report, all_checks, check, run_check
from polyrunner.tools.conformance.report import format_report

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / ".ci" / "hide_packages"
STRUCTURED_SKIP = "end_to_end::structured_outputs: xgrammar is not installed: pip install 'polyrunner[structured]'"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist(requirement: str) -> str:
    return _norm(re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0))


def _project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def optional_distributions() -> dict[str, set[str]]:
    """pyproject.toml's optional-dependencies: distribution name -> the extras listing it."""
    out: dict[str, set[str]] = {}
    for extra, reqs in _project()["optional-dependencies"].items():
        for req in reqs:
            out.setdefault(_dist(req), set()).add(extra)
    return out


@functools.lru_cache(maxsize=None)
def _packages_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def import_names(dist: str, required: set[str]) -> set[str]:
    """The top-level modules distribution `dist` installs (its name when it is not
    installed), less those a required distribution provides too."""
    names = {m for m, dists in _packages_distributions().items()
             if m.isidentifier() and not m.startswith("_") and dist in {_norm(d) for d in dists}
             and not {_norm(d) for d in dists} & required}
    return names or {dist.replace("-", "_")}


def hidden_env(names) -> dict[str, str]:
    return dict(os.environ, HIDE_PACKAGES=",".join(sorted(names)), PYTHONPATH=str(SHIM))


def _all_optional_names() -> tuple[set[str], set[str]]:
    """(distribution names, import names) of every optional package (an extra that only
    pins a required distribution, e.g. `cpu = ["torch==2.13.0"]`, makes it no optional one)."""
    required = {_dist(r) for r in _project()["dependencies"]}
    dists = set(optional_distributions()) - required
    return dists, set().union(*(import_names(d, required) for d in dists))


# ---- the skip mechanism ----------------------------------------------------------------
def _check(packages, func=None, requires=()) -> Check:
    return Check("end_to_end", "needs_a_package", func or (lambda ctx: "ran"), tuple(requires), "",
                 tuple(packages.items()))


@pytest.fixture(scope="module")
def ctx():
    with ConformanceContext("cpu") as c:
        yield c


def test_missing_package_skips_with_package_and_extra(ctx):
    ran = []
    c = _check({"polyrunner_no_such_package": "structured"}, func=lambda ctx: ran.append(1))
    r = run_check(c, ctx)
    assert r.outcome == SKIPPED and r.package_missing and not ran
    assert r.excused_by == "polyrunner_no_such_package is not installed: pip install 'polyrunner[structured]'"
    text = format_report(Report("cpu", [r]))
    assert "skipped (optional packages not installed):" in text
    assert "end_to_end::needs_a_package: polyrunner_no_such_package is not installed" in text
    assert "excused by declared capabilities" not in text
    assert Report("cpu", [r]).passed


def test_capability_excuse_comes_first(ctx):
    c = _check({"polyrunner_no_such_package": "structured"}, requires=("async_scheduling",))
    r = run_check(c, ctx)
    assert r.outcome == SKIPPED and not r.package_missing
    assert r.excused_by == "capabilities.async_scheduling=False"


def test_installed_packages_run_the_check(ctx):
    r = run_check(_check({"numpy": "cpu", "json": ""}), ctx)
    assert r.outcome == PASSED and r.detail == "ran"


@pytest.mark.parametrize("body, error", [
    ("raise ImportError('libfoo.so: cannot open shared object file')", "libfoo.so"),
    ("import polyrunner_missing_dependency_of_a_package", "polyrunner_missing_dependency_of_a_package"),
], ids=["broken_native_library", "missing_own_dependency"])
def test_a_broken_install_is_no_excuse(ctx, tmp_path, monkeypatch, body, error):
    """Installed but failing to import: the check runs and reports the error, not a skip."""
    (tmp_path / "polyrunner_broken_pkg.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def needs_it(ctx):
        import polyrunner_broken_pkg  # noqa: F401
    r = run_check(_check({"polyrunner_broken_pkg": "structured"}, func=needs_it), ctx)
    assert r.outcome == "error" and error in r.detail, r


def test_packages_are_import_names():
    with pytest.raises(ValueError, match="import name"):
        check("end_to_end", packages={"polyrunner[structured]": "structured"})


def test_declared_extras_install_the_packages():
    """Every (package, extra) a check declares is an extra of pyproject.toml that
    installs that package: the printed `pip install 'polyrunner[extra]'` works."""
    dists = optional_distributions()
    declared = [(c.id, p, e) for c in all_checks() for p, e in c.packages]
    assert ("end_to_end::structured_outputs", "xgrammar", "structured") in declared
    for cid, package, extra in declared:
        assert any(extra in extras and package in import_names(dist, set()) for dist, extras in dists.items()), \
            f"{cid}: no requirement of extra {extra!r} installs {package!r}"


# ---- absence, simulated honestly -------------------------------------------------------
def test_shim_hides_modules_and_distributions():
    code = ("import importlib.util, importlib.metadata as md\n"
            "assert importlib.util.find_spec('xgrammar') is None\n"
            "try:\n    import xgrammar.testing\nexcept ModuleNotFoundError as e:\n    assert e.name == 'xgrammar'\n"
            "else:\n    raise SystemExit('imported')\n"
            "try:\n    md.version('xgrammar')\nexcept md.PackageNotFoundError:\n    pass\n"
            "else:\n    raise SystemExit('metadata visible')\n"
            "import numpy, torch, polyrunner\n")
    proc = subprocess.run([sys.executable, "-c", code], env=hidden_env({"xgrammar"}), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_makefile_hides_every_optional_package():
    """`make test`'s run without optional packages hides all of them."""
    line = re.search(r"^OPTIONAL_PACKAGES := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    listed = set(line.group(1).split(","))
    dists, modules = _all_optional_names()
    missing = (modules - listed) | (dists - {_norm(n) for n in listed})   # the shim normalizes distribution names
    assert not missing, f"add {sorted(missing)} to OPTIONAL_PACKAGES in the Makefile"


def test_cli_passes_without_optional_packages():
    """`polyrunner conformance --backend cpu` with every optional package hidden: exit 0,
    the structured-outputs check skipped naming xgrammar and `polyrunner[structured]`.
    (Without the distributed group, which spawns ranks for half a minute and touches
    no optional package; `make test` runs the whole suite so.)"""
    exe = Path(sys.executable).with_name("polyrunner")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "polyrunner.tools.cli"]
    groups = [a for g in GROUPS if g != "distributed" for a in ("--group", g)]
    proc = subprocess.run(cmd + ["conformance", "--backend", "cpu", "--threads", "1", *groups],
                          env=hidden_env(set.union(*_all_optional_names())), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skipped (optional packages not installed):" in proc.stdout
    assert STRUCTURED_SKIP in proc.stdout, proc.stdout
    assert "PASSED:" in proc.stdout


def test_pytest_plugin_reports_the_missing_package(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "polyrunner.tools.conformance.pytest_plugin", "--pyargs",
         "polyrunner.tools.conformance", "--backend", "cpu", "--conformance-group", "end_to_end",
         "-k", "structured_outputs", "--conformance-threads", "1", "-q", "-p", "no:cacheprovider", "-rs"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, env=hidden_env({"xgrammar"}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout
    assert "xgrammar is not installed: pip install 'polyrunner[structured]'" in proc.stdout
