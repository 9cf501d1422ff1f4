"""pyproject lists packages explicitly (core/ and backends/ are mapped onto
`polyrunner`); every package folder must be listed or a wheel would miss it."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for top, prefix in (("core", "polyrunner"), ("backends", "polyrunner.backends")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top).parts
            found.add(".".join((prefix, *rel)))
    assert found - listed == set(), f"add to pyproject packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed but missing: {sorted(listed - found)}"


def test_builtin_backends_register_through_entry_points():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = cfg["project"]["entry-points"]["polyrunner.backends"]
    assert set(eps) == {"cpu", "cuda", "xla", "npu"}
    from polyrunner.plugins import list_backends
    infos = {i.name: i for i in list_backends()}
    assert infos["cpu"].availability.available
    for name in ("cuda", "xla", "npu"):
        assert not infos[name].availability.available and infos[name].availability.reason
