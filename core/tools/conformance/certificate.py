"""What a conformance report certifies: the software and host it ran on.

`collect_environment(backend, command)` gathers, without naming any device:

    date              UTC time the run started, ISO 8601 ("2026-12-02T00:41:07Z")
    command           the command line that produced the report
    versions          {"polyrunner", "torch", "python"} versions
    plugin            the backend's class and module, how it was registered (entry point or
                      run time), and the distribution (name, version) that module comes from
                      (the built-ins: polyrunner; a third-party plugin: its own package;
                      null when the module belongs to no installed distribution)
    device_libraries  [{"distribution", "version"}] the backend runs on (version null: not
                      installed). The backend names them in `Backend.device_libraries`
                      (distribution names); when empty, they are the plugin distribution's
                      requirements for the extra named after the backend
                      (`<distribution>[<backend name>]`); polyrunner and torch
                      are left out (they are in `versions`)
    device            `Availability.device` of the backend's probe ("" when unavailable)
    host              {"platform", "machine", "cpu_model", "cpu_flags"}: cpu_flags are the
                      instruction-set flags relevant to kernels (`ISA_FLAGS`) that
                      /proc/cpuinfo lists (Linux); an empty list elsewhere

Every lookup is best-effort: a value that cannot be found is null (or empty), never an
error, so a report is always written.
"""

from __future__ import annotations

import datetime
import importlib.metadata as metadata
import platform
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1

# Instruction-set flags kernels dispatch on (x86 and Arm names as /proc/cpuinfo spells them).
ISA_FLAGS = (
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c",
    "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_fp16",
    "avx512_vnni", "avx_vnni", "avx_vnni_int8", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "asimd", "asimdhp", "asimddp", "fphp", "bf16", "i8mm", "sve", "sve2", "sme",
)
_EXCLUDED = {"polyrunner", "torch"}


@dataclass
class Library:
    distribution: str
    version: str | None            # None: not installed


@dataclass
class PluginInfo:
    backend_class: str = ""        # module.QualName of the Backend subclass
    module: str = ""
    registered_via: str = ""       # "entry point <name> = <value>" or "run-time plugin <name>"
    distribution: str | None = None
    version: str | None = None


@dataclass
class Host:
    platform: str = ""
    machine: str = ""
    cpu_model: str = ""
    cpu_flags: list[str] = field(default_factory=list)


@dataclass
class Environment:
    date: str = ""
    command: str = ""
    versions: dict[str, str | None] = field(default_factory=dict)
    plugin: PluginInfo = field(default_factory=PluginInfo)
    device_libraries: list[Library] = field(default_factory=list)
    device: str = ""
    host: Host = field(default_factory=Host)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, list[str]]:
    """(model name, the `ISA_FLAGS` the CPU has, in `ISA_FLAGS` order); ("", []) without /proc/cpuinfo."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "", []
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, [f for f in ISA_FLAGS if f in flags]


def _plugin_distribution(module: str, entry_point) -> tuple[str | None, str | None]:
    if entry_point is not None and getattr(entry_point, "dist", None) is not None:
        return entry_point.dist.name, entry_point.dist.version
    top = module.split(".", 1)[0]
    names = metadata.packages_distributions().get(top) or []
    if not names:
        return None, None
    return names[0], _version(names[0])


def _requirement(spec: str, extra: str) -> str | None:
    """The distribution `spec` (a Requires-Dist line) names, when the extra `extra`
    asks for it on this platform."""
    try:
        from packaging.requirements import Requirement
        req = Requirement(spec)
        if req.marker is None or "extra" not in str(req.marker) or not req.marker.evaluate({"extra": extra}):
            return None
        return req.name
    except ImportError:   # packaging is not a dependency: read the name and the extra marker only
        name, _, marker = spec.partition(";")
        want = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if want is None or want.group(1) != extra:
            return None
        return re.match(r"\s*([A-Za-z0-9._-]+)", name).group(1)
    except Exception:  # noqa: BLE001 - an unparsable requirement names no library
        return None


def device_libraries(cls, backend: str, distribution: str | None) -> list[Library]:
    """The distributions the backend runs on, with their installed versions (see module doc)."""
    declared = getattr(cls, "device_libraries", ())   # Backend declares it; tolerate any class
    if declared:
        names = [str(n) for n in declared]
    elif distribution:
        names = [n for s in metadata.requires(distribution) or [] if (n := _requirement(s, backend))]
    else:
        names = []
    seen, out = set(), []
    for n in names:
        key = _normalize(n)
        if key in _EXCLUDED or key in seen:
            continue
        seen.add(key)
        out.append(Library(n, _version(n)))
    return out


def _registration(backend: str, cls) -> tuple[str, object]:
    """(how the backend was registered, its entry point or None)."""
    from polyrunner.plugins import get_plugin_manager
    from polyrunner.plugins.manager import ENTRY_POINT_GROUP
    plugin_name = ""
    for impl in get_plugin_manager().hook.polyrunner_backends.get_hookimpls():
        try:
            contributed = impl.function() or []
        except Exception:  # noqa: BLE001 - registration reports a plugin that fails
            continue
        if any(c is cls for c in contributed):
            plugin_name = impl.plugin_name
            break
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == plugin_name:
            return f"entry point {ep.name} = {ep.value}", ep
    return (f"run-time plugin {plugin_name}" if plugin_name else ""), None


def collect_environment(backend: str, command: list[str] | str | None = None) -> Environment:
    """The environment of a run against `backend` (see the module docstring);
    `command` defaults to this process's command line."""
    import torch

    from polyrunner.plugins.manager import _probe, backend_classes
    if command is None:
        command = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else []
    env = Environment(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        command=command if isinstance(command, str) else shlex.join(command),
        versions={"polyrunner": _version("polyrunner") or _polyrunner_version(), "torch": torch.__version__,
                  "python": platform.python_version()})
    model, flags = cpu_info() if sys.platform.startswith("linux") else ("", [])
    env.host = Host(platform.platform(), platform.machine(), model or platform.processor(), flags)
    cls = backend_classes().get(backend)
    if cls is None:
        return env
    how, ep = _registration(backend, cls)
    dist, version = _plugin_distribution(cls.__module__, ep)
    env.plugin = PluginInfo(f"{cls.__module__}.{cls.__qualname__}", cls.__module__, how, dist, version)
    env.device_libraries = device_libraries(cls, backend, dist)
    try:
        env.device = _probe(cls).device or ""
    except Exception:  # noqa: BLE001 - registration::probe_never_raises reports it
        env.device = ""
    return env


def _polyrunner_version() -> str:
    import polyrunner
    return getattr(polyrunner, "__version__", "")
