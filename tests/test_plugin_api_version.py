"""The plugin contract is versioned: a plugin declares the `PLUGIN_API_VERSION` it is written for and
is refused at registration (run time or entry point) when it declares none, a malformed one, another
major version or a newer minor version, with a message naming both versions."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from polyrunner.plugin_api import PLUGIN_API_VERSION, Availability, Backend, PluginVersionError, hookimpl
from polyrunner.plugins import register
from polyrunner.plugins.manager import backend_classes, unregister


def _plugin(version: str | None, backend: str) -> object:
    class _Backend(Backend):
        name = backend

        @classmethod
        def probe(cls) -> Availability:
            return Availability(True)

    class _VersionedPlugin:
        @hookimpl
        def polyrunner_backends(self):
            return [_Backend]

    plugin = _VersionedPlugin()
    if version is not None:
        plugin.PLUGIN_API_VERSION = version
    return plugin


def test_the_version_is_major_minor() -> None:
    major, minor = PLUGIN_API_VERSION.split(".")
    assert major.isdigit() and minor.isdigit() and int(major) >= 1


def test_a_plugin_of_this_version_registers() -> None:
    register(_plugin(PLUGIN_API_VERSION, "test-api-ok"), name="test-api-ok")
    try:
        assert "test-api-ok" in backend_classes()
    finally:
        unregister("test-api-ok")


@pytest.mark.parametrize("declared,words", [
    (None, ["declares no PLUGIN_API_VERSION", f"PLUGIN_API_VERSION = {PLUGIN_API_VERSION!r}"]),
    ("2.0", ["'2.0'", repr(PLUGIN_API_VERSION), "major versions must match"]),
    ("0.9", ["'0.9'", repr(PLUGIN_API_VERSION)]),
    (f"{PLUGIN_API_VERSION.split('.')[0]}.{int(PLUGIN_API_VERSION.split('.')[1]) + 1}", ["minor version"]),
    ("1", ["'<major>.<minor>'"]),
    (1.0, ["'<major>.<minor>'"]),
])
def test_other_versions_are_refused_at_registration(declared, words) -> None:
    with pytest.raises(PluginVersionError) as err:
        register(_plugin(declared, "test-api-bad"), name="test-api-bad")
    message = str(err.value)
    assert "plugin 'test-api-bad'" in message
    for word in words:
        assert word in message
    assert "test-api-bad" not in backend_classes()


def test_an_entry_point_plugin_of_another_major_version_is_listed_as_unavailable(tmp_path: Path) -> None:
    """Installed plugins load through the entry-point group; a refused one does not register and shows
    up as an unavailable backend saying why (selecting it raises that reason)."""
    (tmp_path / "old_api_plugin.py").write_text(textwrap.dedent("""
        from polyrunner.plugin_api import Availability, Backend, hookimpl
        PLUGIN_API_VERSION = "0.1"
        class OldBackend(Backend):
            name = "old_api"
            @classmethod
            def probe(cls):
                return Availability(True)
        @hookimpl
        def polyrunner_backends():
            return [OldBackend]
    """))
    info = tmp_path / "old_api_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: old-api-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[polyrunner.backends]\nold_api = old_api_plugin\n")
    code = textwrap.dedent("""
        import sys
        from polyrunner.plugins.manager import backend_classes, list_backends, select_backend
        assert "old_api" not in backend_classes()
        info = {i.name: i for i in list_backends()}["old_api"]
        assert not info.availability.available
        print(info.availability.reason)
        try:
            select_backend("old_api")
        except RuntimeError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    reason, selected = out.stdout.strip().splitlines()
    assert "PluginVersionError" in reason and "'0.1'" in reason and repr(PLUGIN_API_VERSION) in reason
    assert "backend 'old_api' is unavailable" in selected and "'0.1'" in selected
