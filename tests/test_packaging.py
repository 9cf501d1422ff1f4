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


def test_backends_import_only_the_plugin_api():
    """A built-in backend is a plugin like any other: from polyrunner it imports
    `polyrunner.plugin_api` (and its own package), nothing else."""
    import ast
    bad = []
    for path in sorted((ROOT / "backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if n.split(".")[0] == "polyrunner" and n != "polyrunner.plugin_api"
                    and not n.startswith("polyrunner.backends.")]
    assert not bad, bad
