"""pytest front-end of the conformance suite: one test item per check.

    pytest -p polyrunner.tools.conformance.pytest_plugin --pyargs polyrunner.tools.conformance --backend NAME

Options: `--backend NAME` (required to run anything), `--conformance-plugin
MODULE[:ATTR]` (register a plugin at run time first; repeatable),
`--conformance-group GROUP` (repeatable), `--conformance-threads N`. Items are named
`test_conformance[<group>::<check>]`; a check excused by a declared
capability is reported as skipped with that capability as the reason; one whose
feature needs an optional package that is not installed, as skipped naming the
package and the extra that installs it; one whose prerequisite failed in this
session, as skipped "blocked by <group>::<check>" (the session still fails:
the prerequisite is a failed test).

With `--junitxml FILE`, each check is a testcase with classname
`polyrunner.conformance.<group>` and name `<check>`, wherever polyrunner is
installed (pytest would otherwise derive the classname from the install path).

Not registered as a `pytest11` entry point on purpose: it adds a `--backend`
option, which must not appear in (or clash with) unrelated pytest runs.
"""

from __future__ import annotations

import warnings

import pytest

JUNIT_CLASSNAME = "polyrunner.conformance.{group}"


def pytest_addoption(parser) -> None:
    group = parser.getgroup("polyrunner-conformance", "polyrunner backend conformance suite")
    group.addoption("--backend", action="store", default=None, metavar="NAME",
                    help="run the polyrunner conformance suite against this registered backend")
    group.addoption("--conformance-plugin", action="append", default=[], metavar="MODULE[:ATTR]",
                    help="register this polyrunner plugin at run time before the suite runs")
    group.addoption("--conformance-group", action="append", default=[], metavar="GROUP",
                    help="only run these check groups")
    group.addoption("--conformance-threads", type=int, default=None, metavar="N",
                    help="torch CPU threads for the suite")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "conformance(group): a polyrunner conformance check")


def pytest_generate_tests(metafunc) -> None:
    if "conformance_check" not in metafunc.fixturenames:
        return
    from polyrunner.tools.conformance.framework import select_checks
    checks = select_checks(metafunc.config.getoption("--conformance-group") or None)
    metafunc.parametrize("conformance_check", checks, ids=[c.id for c in checks])


@pytest.fixture(scope="session")
def conformance_context(request):
    name = request.config.getoption("--backend")
    if not name:
        pytest.skip("pass --backend NAME to run the polyrunner conformance suite")
    from polyrunner.tools.conformance.cli import register_plugin
    from polyrunner.tools.conformance.context import ConformanceContext
    for spec in request.config.getoption("--conformance-plugin"):
        register_plugin(spec)
    threads = request.config.getoption("--conformance-threads")
    if threads:
        import torch
        torch.set_num_threads(threads)
    ctx = ConformanceContext(name)
    yield ctx
    ctx.close()


def junit_names(request, check) -> None:
    """Name the JUnit testcase `polyrunner.conformance.<group>` / `<check>` (when
    --junitxml is on), through pytest's `record_xml_attribute` fixture; its
    'experimental' and 'xunit2' warnings are silenced here only."""
    if not request.config.getoption("xmlpath", None):   # no --junitxml (or the junitxml plugin is off)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestWarning)
        record = request.getfixturevalue("record_xml_attribute")
    record("classname", JUNIT_CLASSNAME.format(group=check.group))
    record("name", check.name)


def run_one(check, ctx) -> None:
    """Run one check as a pytest test: fail with the check's message, skip with its
    excuse or with "blocked by <check>" when a prerequisite failed."""
    from polyrunner.tools.conformance.framework import BLOCKED, PASSED, SKIPPED, run_check
    result = run_check(check, ctx)
    if result.outcome == BLOCKED:
        pytest.skip(result.detail)
    if result.outcome == SKIPPED:
        pytest.skip(result.excused_by if result.package_missing else f"excused: {result.excused_by}")
    if result.outcome != PASSED:
        pytest.fail(f"[{result.id}] {result.outcome}: {result.detail}", pytrace=False)
