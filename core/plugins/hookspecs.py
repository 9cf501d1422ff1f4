"""Hook specifications: the only ways a plugin extends polyrunner.

A plugin is any object (usually a module) with functions marked `@hookimpl`
whose names match the specs below. Built-in backends are plugins registered
through the `polyrunner.backends` entry-point group, exactly like third-party
ones; user code may also call `polyrunner.plugins.register(obj)` at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from polyrunner.device.backend import Backend
    from polyrunner.config import EngineConfig

PROJECT = "polyrunner"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def polyrunner_backends() -> "list[type[Backend]]":
    """Return the Backend subclasses this plugin contributes.

    Must not import the device library: classes are probed later with
    `Backend.probe()`, which reports a missing library as unavailable.
    Backend names must be unique across all plugins.
    """


@hookspec
def polyrunner_models() -> "dict[str, type]":
    """Return model classes keyed by the Hugging Face architecture name
    (`config.json` "architectures"), e.g. {"LlamaForCausalLM": MyLlama}.
    A later-registered plugin overrides an earlier one for the same name."""


@hookspec
def polyrunner_adjust_config(config: "EngineConfig", backend: "Backend") -> None:
    """Adjust the validated engine config in place once the backend is chosen
    (e.g. force a block size the device's kernel needs). Raise ValueError to
    refuse a configuration the backend cannot run."""
