"""Plugin system on pluggy: hook specifications and the plugin manager."""

from polyrunner.plugins.hookspecs import hookimpl, hookspec
from polyrunner.plugins.manager import (
    ENTRY_POINT_GROUP,
    BackendInfo,
    create_backend,
    get_plugin_manager,
    list_backends,
    register,
    select_backend,
)

__all__ = ["hookimpl", "hookspec", "ENTRY_POINT_GROUP", "BackendInfo", "get_plugin_manager",
           "list_backends", "register", "select_backend", "create_backend"]
