"""The conformance checks as pytest items, one per check:

    pytest -p polyrunner.tools.conformance.pytest_plugin --pyargs polyrunner.tools.conformance --backend NAME
"""

import pytest

from polyrunner.tools.conformance.pytest_plugin import junit_names, run_one


@pytest.fixture
def conformance_check():
    """Replaced by the plugin's parametrization; here only when the plugin is not loaded."""
    pytest.skip("load the plugin: pytest -p polyrunner.tools.conformance.pytest_plugin "
                "--pyargs polyrunner.tools.conformance --backend NAME")


def test_conformance(request, conformance_check):
    junit_names(request, conformance_check)
    run_one(conformance_check, request.getfixturevalue("conformance_context"))
