"""The marker table names real test modules, and the markers it sets are registered."""

from __future__ import annotations

import tomllib
from pathlib import Path

from markers import MODULE_MARKERS

ROOT = Path(__file__).resolve().parents[1]


def test_every_marked_module_exists() -> None:
    missing = [m for m in MODULE_MARKERS if not (ROOT / "tests" / f"{m}.py").exists()]
    assert not missing, f"tests/markers.py names modules that do not exist: {missing}"


def test_the_markers_are_registered() -> None:
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {line.split(":")[0] for line in ini["markers"]}
    used = {marker for markers in MODULE_MARKERS.values() for marker in markers}
    assert used <= registered and "--strict-markers" in ini["addopts"]
