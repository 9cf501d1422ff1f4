"""Registration and probing: the backend is discoverable, identifies itself
consistently, and `probe()` never raises."""

from __future__ import annotations

import importlib.metadata

import torch

from polyrunner.tools.conformance.framework import check, expect, fail

GRAPH_MODES = {"eager", "torch_compile", "cuda_graph", "xla", "acl_graph", "cpu_graph"}


def _contributions(name: str) -> list[tuple[str, type]]:
    """(plugin name, class) of every plugin contributing a backend called `name`."""
    from polyrunner.plugins import get_plugin_manager
    pm = get_plugin_manager()
    out = []
    for impl in pm.hook.polyrunner_backends.get_hookimpls():
        for cls in impl.function() or []:
            if getattr(cls, "name", None) == name:
                out.append((impl.plugin_name, cls))
    return out


@check("registration")
def check_discovered(ctx) -> str:
    """The backend is contributed by exactly one plugin, loaded from the
    `polyrunner.backends` entry-point group or registered at run time."""
    from polyrunner.plugins.manager import ENTRY_POINT_GROUP, _broken
    name = ctx.backend_name
    if name in _broken:
        fail(f"entry point {name!r} is installed but failed to load: {_broken[name]}")
    found = _contributions(name)
    if not found:
        from polyrunner.plugins.manager import backend_classes
        fail(f"no plugin contributes a backend named {name!r}; known: {', '.join(sorted(backend_classes()))}")
    expect(len(found) == 1, f"backend name {name!r} is contributed by several plugins: "
                            f"{[p for p, _ in found]} (names must be unique)")
    plugin, cls = found[0]
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    how = f"entry point {plugin} = {eps[plugin]}" if plugin in eps else f"run-time plugin {plugin!r}"
    from polyrunner.device.backend import Backend
    expect(isinstance(cls, type) and issubclass(cls, Backend),
           f"{cls!r} is not a polyrunner.device.backend.Backend subclass")
    return f"{cls.__module__}.{cls.__qualname__} via {how}"


@check("registration", depends_on=("registration::discovered",))
def check_api_version(ctx) -> str:
    """The contributing plugin declares the plugin API version it is written for, and this
    polyrunner implements it (same major version, minor not newer)."""
    from polyrunner.plugins import get_plugin_manager
    from polyrunner.plugins.api_version import PLUGIN_API_VERSION, PluginVersionError, check_plugin_version
    plugin_name = _contributions(ctx.backend_name)[0][0]
    try:
        declared = check_plugin_version(get_plugin_manager().get_plugin(plugin_name), plugin_name)
    except PluginVersionError as exc:
        fail(str(exc))
    return f"plugin API {declared} (polyrunner implements {PLUGIN_API_VERSION})"


@check("registration", depends_on=("registration::discovered",))
def check_probe_never_raises(ctx) -> str:
    """`probe()` returns an Availability (twice, consistently) and never raises."""
    from polyrunner.device.backend import Availability
    cls = ctx.backend_cls
    expect(cls is not None, f"backend {ctx.backend_name!r} is not registered")
    results = []
    for _ in range(2):
        try:
            a = cls.probe()
        except BaseException as exc:  # noqa: BLE001 - the contract is "never raises"
            fail(f"probe() raised {type(exc).__name__}: {exc}")
        expect(isinstance(a, Availability), f"probe() returned {type(a).__name__}, not Availability")
        expect(isinstance(a.available, bool), f"Availability.available is {a.available!r}, not a bool")
        expect(a.available or a.reason, "an unavailable backend must say why (Availability.reason is empty)")
        results.append(a.available)
    expect(results[0] == results[1], "probe() answered differently on two calls")
    return f"available={results[0]}"


@check("registration", depends_on=("registration::discovered",))
def check_declared_identity(ctx) -> str:
    """Name, priority, capabilities and KV alignment are well-formed declarations."""
    from polyrunner.device.backend import ATTENTION_FEATURES, SAMPLING_FEATURES, Capabilities
    cls = ctx.backend_cls
    expect(cls is not None, f"backend {ctx.backend_name!r} is not registered")
    expect(cls.name == ctx.backend_name, f"class name attribute {cls.name!r} != {ctx.backend_name!r}")
    expect(isinstance(cls.priority, int), f"priority must be an int, got {cls.priority!r}")
    caps = cls.capabilities
    expect(isinstance(caps, Capabilities), f"capabilities is {type(caps).__name__}, not Capabilities")
    expect(caps.graph_mode in GRAPH_MODES, f"graph_mode {caps.graph_mode!r} is not one of {sorted(GRAPH_MODES)}")
    expect(caps.dtypes and all(isinstance(d, torch.dtype) for d in caps.dtypes),
           f"capabilities.dtypes must be a non-empty tuple of torch dtypes, got {caps.dtypes!r}")
    unknown = set(caps.sampling) - SAMPLING_FEATURES
    expect(not unknown, f"capabilities.sampling names unknown features {sorted(unknown)}")
    unknown = set(caps.attention_features) - ATTENTION_FEATURES
    expect(not unknown, f"capabilities.attention_features names unknown features {sorted(unknown)}")
    a = cls.kv_alignment_bytes
    expect(isinstance(a, int) and a >= 1, f"kv_alignment_bytes must be an int >= 1, got {a!r}")
    return f"graph_mode={caps.graph_mode} static_shapes={caps.static_shapes} counts_graphs={caps.counts_graphs}"


@check("registration", depends_on=("registration::discovered",))
def check_available_here(ctx) -> str:
    """The backend is usable on this machine (the other groups need it)."""
    from polyrunner.plugins.manager import _probe
    cls = ctx.backend_cls
    expect(cls is not None, f"backend {ctx.backend_name!r} is not registered")
    a = _probe(cls)
    expect(a.available, f"backend is unavailable here: {a.reason}; the other groups cannot run")
    return a.device or "available"


@check("registration", depends_on=("registration::available_here",))
def check_host_device_primitives(ctx) -> str:
    """create_backend(config) instantiates it; device, default dtype, transfers, RNG and memory info work."""
    import numpy as np
    expect(not ctx.blocker(), ctx.blocker())
    b = ctx.new_backend()
    expect(isinstance(b.device, torch.device), f"device is {type(b.device).__name__}, not torch.device")
    expect(b.default_dtype in b.capabilities.dtypes,
           f"default_dtype {b.default_dtype} is not in capabilities.dtypes {b.capabilities.dtypes}")
    host = np.arange(12, dtype=np.int64)
    dev = b.to_device(host)
    expect(dev.device.type == b.device.type, f"to_device gave a tensor on {dev.device}, not {b.device}")
    back = b.to_host_async(dev * 2).result()
    b.synchronize()
    expect(back.device.type == "cpu" and back.tolist() == (host * 2).tolist(),
           "to_host_async(...).result() did not return the device tensor's values on the host")
    draws = []
    for _ in range(2):
        g = b.make_generator(1234)
        draws.append(torch.rand(4, generator=g, device=g.device).cpu().tolist())
    expect(draws[0] == draws[1], "make_generator(seed) is not reproducible")
    free, total = b.memory_info()
    expect(isinstance(free, int) and isinstance(total, int) and 0 <= free <= total and total > 0,
           f"memory_info() must be ints with 0 <= free <= total, got ({free!r}, {total!r})")
    return f"device={b.device} default_dtype={str(b.default_dtype).removeprefix('torch.')}"
