"""A run-time plugin contributing one backend class, for tests that register a (broken) backend."""

from __future__ import annotations

from polyrunner.plugin_api import PLUGIN_API_VERSION, hookimpl


class BackendPlugin:
    PLUGIN_API_VERSION = PLUGIN_API_VERSION

    def __init__(self, cls) -> None:
        self.cls = cls

    @hookimpl
    def polyrunner_backends(self):
        return [self.cls]
