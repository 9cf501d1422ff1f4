"""Why a device library does not work, and the command that fixes it (`polyrunner backends`).

Backend-neutral: a plugin's `probe()` calls `check_library(...)` for its device library
(torch_xla, torch_npu) and `check_pinned(...)` for a companion (triton). Versions come
from installed distributions' metadata (`importlib.metadata`), the pairs from
`polyrunner.backends.supported_versions`. The library is imported only when its version
fits the installed torch: a mismatched native extension is reported, never loaded.
Nothing here raises.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import shutil
import sys
from dataclasses import dataclass
from types import ModuleType

from polyrunner.backends.supported_versions import (
    CUDA_TORCH_INDEX,
    TORCH_TESTED,
    normalize,
    release,
    stack_for_library,
    torch_for,
)

__all__ = ["Diagnosis", "Runtime", "installed_version", "check_library", "check_pinned", "cuda_torch_fix",
           "find_compiler"]


@dataclass(frozen=True)
class Diagnosis:
    """ok with the imported module, or why not (`reason`) and the command that fixes it (`fix`)."""

    ok: bool
    reason: str = ""
    fix: str = ""
    module: ModuleType | None = None
    version: str = ""


@dataclass(frozen=True)
class Runtime:
    """A native runtime a library loads at import: an import error matching `pattern`
    (a regular expression, case-insensitive) means the runtime is missing, fixed by `fix`."""

    name: str
    pattern: str
    fix: str


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution`, None when not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - broken metadata reads as "not installed"
        return None


def _fits(found: str, needed: str) -> bool:
    """found '2.9.0+cpu' fits needed '2.9' and '2.9.0'; not '2.9.1' for '2.9.0'."""
    want = release(needed)
    return release(found)[:len(want)] == want


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def check_library(distribution: str, import_name: str, runtime: Runtime | None = None) -> Diagnosis:
    """Installed, paired with the installed torch (the table's pair or the library's own
    rule), importable. The fix is the extra that installs the pair, or the runtime's fix."""
    stack = stack_for_library(distribution)
    install = stack.install if stack else f"pip install {distribution}"
    version = installed_version(distribution)
    if version is None and import_name not in sys.modules and importlib.util.find_spec(import_name) is None:
        return Diagnosis(False, f"{distribution} is not installed", install)
    version = version or str(getattr(sys.modules.get(import_name), "__version__", "") or "")
    label = f"{distribution} {version}" if version else distribution
    torch_version = installed_version("torch") or "?"
    needed = torch_for(distribution, version) if version else None
    if needed and not _fits(torch_version, needed):
        return Diagnosis(False, f"{label} needs torch {needed}, found {torch_version}", install, version=version)
    if import_name in sys.modules:   # autoloaded by `import torch`, or imported by the user
        return Diagnosis(True, module=sys.modules[import_name], version=version)
    try:
        module = importlib.import_module(import_name)
    except BaseException as exc:  # noqa: BLE001 - a broken install is a diagnosis, not a crash
        if isinstance(exc, KeyboardInterrupt):
            raise
        error = _first_line(exc)
        if runtime is not None and re.search(runtime.pattern, str(exc), re.I):
            return Diagnosis(False, f"{label} cannot load the {runtime.name} runtime ({error})",
                             runtime.fix, version=version)
        if "undefined symbol" in str(exc):
            return Diagnosis(False, f"{label} does not match torch {torch_version} ({error})",
                             install, version=version)
        return Diagnosis(False, f"{label} failed to import: {error}", install, version=version)
    return Diagnosis(True, module=module, version=version)


def _torch_pin(distribution: str) -> str | None:
    """The exact version the installed torch's metadata pins `distribution` to, if any."""
    try:
        requires = importlib.metadata.requires("torch") or []
    except Exception:  # noqa: BLE001
        return None
    for req in requires:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([0-9][^;,\s]*)", req)
        if m and normalize(m.group(1)) == normalize(distribution):
            return m.group(2)
    return None


def check_pinned(distribution: str, import_name: str) -> Diagnosis:
    """A companion torch pins (triton): installed at torch's pin (when torch pins it) and importable."""
    stack = stack_for_library(distribution)
    install = stack.install if stack else f"pip install {distribution}"
    version = installed_version(distribution)
    if version is None and importlib.util.find_spec(import_name) is None:
        return Diagnosis(False, f"{distribution} is not installed", install)
    pin = _torch_pin(distribution)
    if version and pin and release(version) != release(pin):
        return Diagnosis(False, f"torch {installed_version('torch')} needs {distribution} {pin}, found {version}",
                         f"pip install '{distribution}=={pin}'", version=version or "")
    try:
        module = importlib.import_module(import_name)
    except Exception as exc:  # noqa: BLE001
        return Diagnosis(False, f"{distribution} {version} failed to import: {_first_line(exc)}", install,
                         version=version or "")
    return Diagnosis(True, module=module, version=version or "")


def cuda_torch_fix() -> str:
    """The command that replaces a CPU-only torch build with the CUDA build of the tested release."""
    return f"pip install 'torch=={TORCH_TESTED}+cu130' --index-url {CUDA_TORCH_INDEX}"


def find_compiler() -> str | None:
    """A C compiler on PATH (what Triton builds its launcher with), None if there is none."""
    return next((path for cc in ("cc", "gcc", "clang") if (path := shutil.which(cc))), None)
