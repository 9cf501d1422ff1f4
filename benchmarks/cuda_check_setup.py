"""Make polyrunner importable on a bare GPU image without network: `cuda_check.py`'s set-up.

`prepare(wheels, site)`, before anything imports polyrunner:
1. installs every wheel in `wheels` (made here by `cuda_wheels.py`) with
   `pip install --no-index --no-deps --target site` (nothing is fetched);
2. when polyrunner does not already import from this tree, lays out `site/polyrunner` as links
   into the tree (`core/`'s entries, `backends` -> `backends/`; what `pyproject.toml`'s
   package-dir maps) with a dist-info carrying its entry points, so the backends register as
   installed ones do; no build step, no setuptools version to match;
3. puts `site` first on `sys.path` and `PYTHONPATH` (the tests phase's pytest sees it too);
4. imports every module the check needs and names each one missing, with the fix.

Returns a dict for the summary; its "missing" lists the required modules that do not import
(the check then skips its GPU phases with that reason instead of failing each).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("torch", "numpy", "pluggy", "pydantic", "gguf", "safetensors", "tokenizers", "tqdm", "jinja2",
            "pytest", "polyrunner")
OPTIONAL = ("triton", "transformers", "hypothesis")   # the Triton kernels; the tests' oracle and properties
FIX = "run `python benchmarks/cuda_wheels.py` where pip reaches the index, and carry the .whl folder"


def install_wheels(wheels: Path, site: Path) -> list[str]:
    """The wheels in `wheels`, installed into `site` without network; their file names."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if found:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, found)],
                       check=True, capture_output=True, text=True)
    return [w.name for w in found]


def imports_from_tree() -> bool:
    """Whether `import polyrunner` already gives this tree's `core/` (an editable install)."""
    try:
        import polyrunner
    except ImportError:
        return False
    return Path(polyrunner.__file__).resolve().parent == ROOT / "core"


def link_tree(site: Path) -> None:
    """`site/polyrunner`: links to `core/`'s entries plus `backends`, and a dist-info with the entry points."""
    pkg = site / "polyrunner"
    shutil.rmtree(pkg, ignore_errors=True)
    pkg.mkdir(parents=True)
    for entry in (ROOT / "core").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "backends").symlink_to(ROOT / "backends")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = site / f"polyrunner-{project['version']}.dist-info"
    shutil.rmtree(info, ignore_errors=True)
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: polyrunner\nVersion: {project['version']}\n")
    groups = project.get("entry-points", {}) | {"console_scripts": project.get("scripts", {})}
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items()) + "\n"
        for group, eps in groups.items()))


def first_on_path(site: Path) -> None:
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()


def check_imports() -> tuple[list[str], list[str]]:
    """(required modules that fail to import, optional ones), each as 'name (why)'."""
    def failing(names: tuple[str, ...]) -> list[str]:
        out = []
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
                out.append(f"{name} ({type(exc).__name__}: {exc})")
        return out
    return failing(REQUIRED), failing(OPTIONAL)


def prepare(wheels: Path, site: Path) -> dict:
    """Steps 1-4 above; the summary's "setup" entry."""
    out: dict = {}
    try:
        out["wheels"] = install_wheels(wheels, site) or f"none in {wheels}"
    except subprocess.CalledProcessError as exc:
        out["wheels"] = f"pip failed: {(exc.stderr or exc.stdout or '')[-600:]}"
    first_on_path(site)
    if imports_from_tree():
        out["polyrunner"] = "installed from this tree"
    else:
        for name in [m for m in sys.modules if m == "polyrunner" or m.startswith("polyrunner.")]:
            del sys.modules[name]   # another install's, imported by the test above
        link_tree(site)
        importlib.invalidate_caches()
        out["polyrunner"] = f"linked from this tree into {site}"
    missing, optional = check_imports()
    out["missing"] = missing
    if missing:
        out["fix"] = FIX
    if optional:
        out["optional_missing"] = optional
    return out
