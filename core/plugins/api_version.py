"""The plugin contract's version, and the check every plugin passes at registration.

A plugin declares the contract version it was written for as a literal on the
plugin object (for a module plugin, a module-level constant):

    PLUGIN_API_VERSION = "1.0"

It is accepted when its major version equals polyrunner's and its minor version is
not newer (a minor version only adds OPTIONAL members; a major version changes or
removes REQUIRED ones). `docs/plugins.md` ("The contract is versioned") states the rule.
"""

from __future__ import annotations

PLUGIN_API_VERSION = "1.0"


class PluginVersionError(ValueError):
    """A plugin declares no plugin API version, or one this polyrunner does not implement."""


def _parse(version: object, who: str) -> tuple[int, int]:
    parts = version.split(".") if isinstance(version, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise PluginVersionError(f"{who} declares PLUGIN_API_VERSION {version!r}; expected a string "
                                 f"'<major>.<minor>' such as {PLUGIN_API_VERSION!r}")
    return int(parts[0]), int(parts[1])


def check_plugin_version(plugin: object, name: str) -> str:
    """The version `plugin` declares, or PluginVersionError naming both versions."""
    who = f"plugin {name!r}"
    declared = getattr(plugin, "PLUGIN_API_VERSION", None)
    if declared is None:
        raise PluginVersionError(f"{who} declares no PLUGIN_API_VERSION; add PLUGIN_API_VERSION = "
                                 f"{PLUGIN_API_VERSION!r} (the plugin API version it is written for) to it")
    major, minor = _parse(declared, who)
    ours = _parse(PLUGIN_API_VERSION, "polyrunner")
    if major != ours[0] or minor > ours[1]:
        raise PluginVersionError(
            f"{who} declares PLUGIN_API_VERSION {declared!r}, but this polyrunner implements plugin API "
            f"{PLUGIN_API_VERSION!r} (the major versions must match and the plugin's minor version must "
            f"not be newer)")
    return declared
