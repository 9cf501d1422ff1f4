"""The plugin manager: discovery, run-time registration and backend selection."""

from __future__ import annotations

import importlib.metadata
import logging
import types
from dataclasses import dataclass

import pluggy

from polyrunner.config import EngineConfig
from polyrunner.default_limits import apply_default_limits
from polyrunner.device.backend import Availability, Backend
from polyrunner.models.context_length import resolved_max_model_len
from polyrunner.plugins import hookspecs
from polyrunner.plugins.api_version import PluginVersionError, check_plugin_version

ENTRY_POINT_GROUP = "polyrunner.backends"
logger = logging.getLogger(__name__)

_manager: pluggy.PluginManager | None = None
# Entry points whose import failed: name -> reason (listed as unavailable).
_broken: dict[str, str] = {}
# Plugins registered in user code: name -> module name (a module) or the object itself,
# so another process (a tensor-parallel worker) can register the same ones.
_runtime: dict[str, str | object] = {}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager, with entry-point plugins loaded once."""
    global _manager
    if _manager is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
                plugin = pm.get_plugin(ep.name)
                if plugin is not None:
                    try:
                        check_plugin_version(plugin, ep.name)
                    except PluginVersionError:
                        pm.unregister(plugin)
                        raise
            except Exception as exc:  # a broken plugin must not break import
                _broken[ep.name] = f"plugin failed to load: {type(exc).__name__}: {exc}"
                logger.warning("polyrunner plugin %r failed to load: %s", ep.name, exc)
        _manager = pm
    return _manager


def register(plugin: object, name: str | None = None) -> None:
    """Register a plugin defined in user code (a module or object with hookimpls and its
    `PLUGIN_API_VERSION`); PluginVersionError when that version is missing or not implemented here."""
    check_plugin_version(plugin, name or getattr(plugin, "__name__", type(plugin).__name__))
    pm = get_plugin_manager()
    if name is not None and pm.get_plugin(name) is not None:
        pm.unregister(name=name)
    registered = pm.register(plugin, name=name)
    _runtime[registered] = plugin.__name__ if isinstance(plugin, types.ModuleType) else plugin


def unregister(name: str) -> None:
    get_plugin_manager().unregister(name=name)
    _runtime.pop(name, None)


def runtime_plugins() -> dict[str, str | object]:
    """The plugins `register` added (module names, or objects), to pass to another process."""
    return dict(_runtime)


def register_runtime_plugins(plugins: dict[str, str | object]) -> None:
    """Register another process's `runtime_plugins()` here (modules are imported)."""
    for name, plugin in plugins.items():
        register(importlib.import_module(plugin) if isinstance(plugin, str) else plugin, name)


@dataclass(frozen=True)
class BackendInfo:
    name: str
    cls: type[Backend] | None
    availability: Availability
    priority: int
    graph_mode: str


def _probe(cls: type[Backend]) -> Availability:
    try:
        return cls.probe()
    except Exception as exc:  # the contract says never raise; enforce it
        return Availability(False, f"probe raised {type(exc).__name__}: {exc}")


def backend_classes() -> dict[str, type[Backend]]:
    """All contributed Backend classes by name (later registrations win)."""
    classes: dict[str, type[Backend]] = {}
    for contributed in reversed(get_plugin_manager().hook.polyrunner_backends()):
        for cls in contributed or []:
            classes[cls.name] = cls
    return classes


def model_classes() -> dict[str, type]:
    """Model classes contributed by plugins, by architecture name (later registrations win)."""
    classes: dict[str, type] = {}
    for contributed in reversed(get_plugin_manager().hook.polyrunner_models()):
        classes.update(contributed or {})
    return classes


def list_backends() -> list[BackendInfo]:
    """Every known backend with its probe result, highest priority first."""
    infos = [BackendInfo(name, cls, _probe(cls), cls.priority, cls.capabilities.graph_mode)
             for name, cls in backend_classes().items()]
    infos += [BackendInfo(name, None, Availability(False, reason), -1, "-")
              for name, reason in _broken.items() if name not in {i.name for i in infos}]
    return sorted(infos, key=lambda i: (-i.priority, i.name))


def select_backend(name: str | None = None) -> type[Backend]:
    """The backend class named `name`, or the highest-priority available one; an unknown or
    unavailable backend raises with the probe's reason."""
    infos = list_backends()
    if name is not None:
        by_name = {i.name: i for i in infos}
        if name not in by_name:
            raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(sorted(by_name))}")
        info = by_name[name]
        if not info.availability.available:
            fix = f"; to fix: {info.availability.fix}" if info.availability.fix else ""
            raise RuntimeError(f"backend {name!r} is unavailable: {info.availability.reason}{fix}")
        assert info.cls is not None   # a broken plugin's entry is never available
        return info.cls
    for info in infos:
        if info.availability.available and info.cls is not None:
            return info.cls
    raise RuntimeError("no backend is available: " + "; ".join(
        f"{i.name}: {i.availability.reason}" for i in infos))


def create_backend(config: EngineConfig) -> Backend:
    """One engine's backend: select `config.runner.backend`'s class, fill the scheduler limits
    the user left unset from its `default_limits`, let it adjust `config` in place
    (`Backend.adjust_config`), then make the instance from the adjusted config."""
    cls = select_backend(config.runner.backend)
    apply_default_limits(config, cls.default_limits(config.runner.usage_context),
                         lambda: config.model.max_model_len or resolved_max_model_len(config))
    cls.adjust_config(config)
    return cls(config)
