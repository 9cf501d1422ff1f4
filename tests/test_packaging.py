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
    `polyrunner.plugin_api` (and its own package), nothing else; its `envs.py` may import the
    torch-free `polyrunner.envs` to declare its environment variables."""
    import ast
    bad = []
    for path in sorted((ROOT / "backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if n.split(".")[0] == "polyrunner" and n != "polyrunner.plugin_api"
                    and not n.startswith("polyrunner.backends.")
                    and not (path.name == "envs.py" and n == "polyrunner.envs")]
    assert not bad, bad


# ---- one table of supported pairs, and pyproject agrees with it --------------------------
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from polyrunner.backends import diagnose  # noqa: E402
from polyrunner.backends.supported_versions import STACKS, TORCH_REQUIREMENT, TORCH_TESTED, torch_for  # noqa: E402


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_extras_pin_the_tables_pairs():
    extras = _pyproject()["project"]["optional-dependencies"]
    for name, stack in STACKS.items():
        assert extras.get(name) == stack.requirements(), f"pyproject extra {name!r} != supported_versions"
    deps = [d for d in _pyproject()["project"]["dependencies"] if re.match(r"torch\b", d)]
    assert deps == [TORCH_REQUIREMENT]
    # every place that installs "the tested CPU torch" names the table's release
    for path in ("Makefile", ".ci/fresh_venv.sh"):
        pins = set(re.findall(r"torch==([0-9.]+)", (ROOT / path).read_text()))
        assert pins == {TORCH_TESTED}, (path, pins)


def test_table_rules():
    assert STACKS["xla"].requirements()[1].startswith("torch_xla==2.9.0; ")
    assert STACKS["tpu"].expected()["libtpu"] == "0.0.21"
    assert torch_for("torch_xla", "2.9.0") == "2.9.0"        # the table's pair
    assert torch_for("torch-xla", "2.8.1") == "2.8"          # torch_xla's own rule: same minor
    assert torch_for("torch_npu", "2.11.0.post3") == "2.11.0"
    assert torch_for("triton", "3.7.1") == "2.13.0" and torch_for("triton", "3.8.0") is None


def test_license_and_build_system():
    cfg = _pyproject()
    assert cfg["project"]["license"] == "Apache-2.0"         # SPDX expression, not the deprecated table
    assert cfg["project"]["license-files"] == ["LICENSE"]
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77
               for r in cfg["build-system"]["requires"])
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_manifest_ships_every_tracked_top_level_item():
    """The sdist carries the tests (with tests/data), docs, examples, benchmarks, CI scripts:
    every tracked top-level item is a package folder or named in MANIFEST.in."""
    manifest = (ROOT / "MANIFEST.in").read_text()
    named = set(re.findall(r"^(?:graft|include)\s+(.+)$", manifest, re.M))
    named = {w for line in named for w in line.split()}
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:    # an unpacked sdist: no git; its own files are the list
        top = {p.name for p in ROOT.iterdir() if not p.name.startswith((".venv", "build", "dist"))}
    else:
        top = {line.split("/")[0] for line in tracked.stdout.splitlines()}
    covered = {"core", "backends", ".gitignore", "polyrunner.egg-info", "PKG-INFO", "setup.cfg", "MANIFEST.in"}
    missing = {t for t in top if t not in named and t not in covered}
    assert not missing, f"add to MANIFEST.in: {sorted(missing)}"
    assert {"tests", "docs", "examples", "benchmarks", ".ci", "Makefile", "LICENSE"} <= named


# ---- `polyrunner backends` diagnoses -----------------------------------------------------
def _versions(monkeypatch, **versions):
    table = {k.replace("_", "-"): v for k, v in versions.items()}
    monkeypatch.setattr(diagnose, "installed_version", lambda dist: table.get(dist.replace("_", "-")))


def _imports(monkeypatch, error: BaseException | None, module=None):
    calls = []

    def fake(name):
        calls.append(name)
        if error is not None:
            raise error
        return module
    monkeypatch.setattr(diagnose.importlib, "import_module", fake)
    monkeypatch.setattr(diagnose.importlib.util, "find_spec", lambda name: object())
    return calls


def test_version_mismatch_is_named_with_the_fix_and_not_imported(monkeypatch):
    _versions(monkeypatch, torch="2.13.0+cpu", torch_xla="2.9.0")
    calls = _imports(monkeypatch, AssertionError("a mismatched native library must not be imported"))
    d = diagnose.check_library("torch_xla", "torch_xla")
    assert not d.ok and calls == []
    assert d.reason == "torch_xla 2.9.0 needs torch 2.9.0, found 2.13.0+cpu"
    assert d.fix == "pip install 'polyrunner[xla]'"


def test_import_failure_reports_the_real_error(monkeypatch):
    _versions(monkeypatch, torch="2.9.0", torch_xla="2.9.0")
    _imports(monkeypatch, ImportError("_XLAC.so: undefined symbol: _ZN5torch8autograd10deleteNodeE"))
    d = diagnose.check_library("torch_xla", "torch_xla")
    assert not d.ok and "undefined symbol: _ZN5torch8autograd10deleteNodeE" in d.reason
    assert d.reason.startswith("torch_xla 2.9.0 does not match torch 2.9.0") and d.fix == STACKS["xla"].install
    _imports(monkeypatch, ModuleNotFoundError("No module named 'absl'"))
    d = diagnose.check_library("torch_xla", "torch_xla")
    assert d.reason == "torch_xla 2.9.0 failed to import: ModuleNotFoundError: No module named 'absl'"


def test_missing_cann_runtime(monkeypatch):
    from polyrunner.backends.npu.plugin import CANN, NPUBackend
    _versions(monkeypatch, torch="2.13.0+cpu", torch_npu="2.13.0")
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    _imports(monkeypatch, ImportError("libascendcl.so: cannot open shared object file: No such file or directory"))
    a = NPUBackend.probe()
    assert not a.available
    assert a.reason == ("torch_npu 2.13.0 cannot load the CANN runtime (ImportError: libascendcl.so: cannot open "
                        "shared object file: No such file or directory)")
    assert a.fix == CANN.fix and "set_env.sh" in a.fix
    _imports(monkeypatch, ImportError("cannot import name 'npu_ops' from 'torch_npu._C'"))   # not CANN's
    a = NPUBackend.probe()
    assert a.reason == "torch_npu 2.13.0 failed to import: ImportError: cannot import name 'npu_ops' from " \
                       "'torch_npu._C'" and a.fix == "pip install 'polyrunner[npu]'"


def test_not_installed_names_the_extra(monkeypatch):
    _versions(monkeypatch, torch="2.13.0")
    monkeypatch.setattr(diagnose.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    d = diagnose.check_library("torch_npu", "torch_npu")
    assert (d.ok, d.reason, d.fix) == (False, "torch_npu is not installed", "pip install 'polyrunner[npu]'")


def test_xla_without_tpu_runtime_and_on_cpu_xla(monkeypatch):
    from polyrunner.backends.xla import plugin
    fake = type(sys)("torch_xla")
    fake.device = lambda: "xla:0"
    monkeypatch.setattr(plugin, "check_library", lambda *a: diagnose.Diagnosis(True, module=fake))
    monkeypatch.setattr(plugin, "installed_version", lambda dist: None)
    monkeypatch.setattr(plugin, "_device_kind", lambda: "CPU")
    monkeypatch.setattr(plugin, "_device_count", lambda: 1)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    a = plugin.XLABackend.probe()
    assert not a.available and a.reason.startswith("no TPU found (libtpu is not installed; set PJRT_DEVICE=CPU")
    assert "pip install 'polyrunner[tpu]'" in a.fix
    monkeypatch.setenv("PJRT_DEVICE", "CPU")   # the CPU XLA device needs no libtpu
    a = plugin.XLABackend.probe()
    assert a.available and a.device == "xla:0 (CPU)" and not a.fix


def test_cpu_torch_build_names_the_cuda_install(monkeypatch):
    import torch

    from polyrunner.backends.cuda.plugin import CUDABackend
    monkeypatch.setattr(torch.version, "cuda", None)
    a = CUDABackend.probe()
    assert not a.available and a.reason.endswith("was built without CUDA")
    assert a.fix == f"pip install 'torch=={TORCH_TESTED}+cu130' --index-url https://download.pytorch.org/whl/cu130"


def test_triton_missing_or_not_torchs_pin(monkeypatch):
    from polyrunner.backends.cuda import plugin
    monkeypatch.setattr(diagnose.importlib.util, "find_spec", lambda name: None)
    _versions(monkeypatch, torch="2.13.0")
    note, fix = plugin.triton_note()
    assert note == "triton is not installed: SDPA paged attention (slower decode)"
    assert fix == "pip install 'polyrunner[cuda]'"
    _versions(monkeypatch, torch="2.13.0", triton="3.8.0")
    monkeypatch.setattr(diagnose, "_torch_pin", lambda dist: "3.7.1")
    note, fix = plugin.triton_note()
    assert note.startswith("torch 2.13.0 needs triton 3.7.1, found 3.8.0") and fix == "pip install 'triton==3.7.1'"


def test_cmd_backends_prints_the_fixes(capsys):
    from polyrunner.tools.cli import main
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    fixes = out.split("to fix:", 1)[1]
    if importlib.util.find_spec("torch_xla") is None:
        assert "  xla: pip install 'polyrunner[xla]'" in fixes


# ---- the CI resolution check -------------------------------------------------------------
def _checker():
    spec = importlib.util.spec_from_file_location("check_resolution", ROOT / ".ci" / "check_resolution.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LINUX_X86 = {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux",
             "python_version": "3.11", "python_full_version": "3.11.7", "os_name": "posix",
             "implementation_name": "cpython", "platform_python_implementation": "CPython",
             "platform_release": "", "platform_version": "", "implementation_version": "3.11.7"}


def _report(env=LINUX_X86, **dists):
    return {"environment": env, "install": [{"metadata": {"name": n.replace("__", "-"), "version": v}}
                                            for n, v in dists.items()]}


def test_resolution_checker_on_canned_reports(tmp_path):
    check = _checker().check
    summary, problems = check("cpu", _report(torch="2.13.0+cpu", numpy="2.3.0"))
    assert problems == [] and summary.startswith("[cpu] torch 2.13.0+cpu (cpu build, 0 CUDA libraries)")
    # what `pip install '.[cpu]'` resolved before: the newest CUDA torch
    _, problems = check("cpu", _report(torch="2.14.1", nvidia__cublas="13.0", cuda__toolkit="13.0.3"))
    assert problems == ["torch 2.14.1 is outside torch>=2.9,<2.14", "torch resolved to 2.14.1, the table says 2.13.0",
                        "a CUDA build of torch: 2 CUDA libraries (cuda-toolkit, nvidia-cublas, ...)"]
    _, problems = check("tpu", _report(torch="2.9.0", torch_xla="2.9.0", libtpu="0.0.21", jax="0.7.1"))
    assert problems == ["jaxlib is missing (expected 0.7.1)"]
    mac = dict(LINUX_X86, sys_platform="darwin", platform_system="Darwin", platform_machine="arm64")
    assert check("xla", _report(mac, torch="2.13.0"))[1] == []
    assert check("xla", _report(mac, torch="2.13.0", torch_xla="2.9.0"))[1] == [
        "torch-xla 2.9.0 is installed where the extra does not apply "
        "(sys_platform == 'linux' and platform_machine == 'x86_64')"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_report(torch="2.13.0", torch_npu="2.14.0")))
    proc = subprocess.run([sys.executable, str(ROOT / ".ci" / "check_resolution.py"), "npu", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "torch-npu resolved to 2.14.0, the table says 2.13.0" in proc.stdout


@pytest.mark.parametrize("script", ["resolve_extras.sh", "floors.sh"])
def test_ci_runs_the_packaging_steps(script):
    assert (ROOT / ".ci" / script).exists()
    run = (ROOT / ".ci" / "run").read_text()
    assert f".ci/{script}" in run or script == "floors.sh"


def test_readme_install_table_matches_the_stacks():
    readme = (ROOT / "README.md").read_text()
    for name, stack in STACKS.items():
        row = re.search(rf"^\| `{name}` \|(.+)$", readme, re.M)
        assert row, f"README's install table has no row for the {name!r} extra"
        assert f"torch {stack.torch}" in row.group(1) or name == "tpu"
        if stack.library and name != "tpu":
            assert f"{stack.library} {stack.version}" in row.group(1), (name, row.group(1))
        for dist, version in stack.brings.items():
            assert version in row.group(1), (name, dist)
