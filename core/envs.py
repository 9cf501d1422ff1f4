"""Every environment variable polyrunner reads, declared once: name, type, default, meaning.

Modules read a variable through the object `declare` returned (`CACHE.get()`), never
through `os.environ` directly, so this registry is the one list the README's table is
generated from (`python -m polyrunner.tools.env_table`). Backends declare their own
variables in their own `envs` module (`backends/<name>/envs.py`, `section="<name>"`)
with the same `declare`; the core never names them.

Types: `bool` (1/0, true/false, yes/no, on/off), `int`, `float` (bounded by `ge`/`gt`),
`str` (with `choices`: one of them, case-insensitive), `list` (comma-separated integers).
`int` with `choices` also takes those words (`"auto"` or an integer >= 1). An unset or
empty variable gives the default; a bad value is a ValueError naming the variable and
what it accepts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EnvVar", "declare", "declared", "cache_root", "CACHE", "LOGGING_LEVEL", "ENGINE_PROCESS",
           "TP_TIMEOUT_S", "GRAMMAR_COMPILE_TIMEOUT_S"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_TYPES = (bool, int, float, str, list)


@dataclass(frozen=True)
class EnvVar:
    """One variable. `get()` parses it on every call (tests and users may change it at run time)."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    section: str = "core"
    ge: float | None = None
    gt: float | None = None

    def is_set(self) -> bool:
        return os.environ.get(self.name, "") != ""

    def raw(self) -> str | None:
        value = os.environ.get(self.name, "")
        return value if value != "" else None

    def expected(self) -> str:
        """What the variable accepts, in words ("an integer >= 0", "'auto' or an integer >= 1")."""
        if self.type is bool:
            return "1 or 0 (true/false, yes/no, on/off)"
        if self.type is list:
            return "a comma-separated list of integers"
        words = " or ".join(repr(c) for c in self.choices or ())
        if self.type is str:
            return f"one of {', '.join(self.choices)}" if self.choices else "a string"
        what = "an integer" if self.type is int else "a number"
        bound = f" >= {self.ge:g}" if self.ge is not None else f" > {self.gt:g}" if self.gt is not None else ""
        return f"{words} or {what}{bound}" if words else f"{what}{bound}"

    def get(self) -> Any:
        """The parsed value, or the default when unset or empty; ValueError names the variable."""
        raw = self.raw()
        return self.default if raw is None else self.parse(raw)

    def parse(self, raw: str) -> Any:
        """`raw` as this variable's type; ValueError "NAME must be <expected>, got 'raw'"."""
        text = raw.strip()
        if self.type is bool:
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
        elif self.choices is not None and text.lower() in self.choices:
            return text.lower()
        elif self.type is str:
            if self.choices is None:
                return raw
        elif self.type is list:
            try:
                values = [int(x) for x in text.replace(" ", "").split(",") if x]
            except ValueError:
                values = []
            if values:
                return values
        else:
            try:
                value = self.type(text)
            except ValueError:
                pass
            else:
                if (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt):
                    return value
        raise ValueError(f"{self.name} must be {self.expected()}, got {raw!r}")


_REGISTRY: dict[str, EnvVar] = {}


def declare(name: str, type: type, default: Any, help: str, *, choices: tuple[str, ...] | None = None,
            section: str = "core", ge: float | None = None, gt: float | None = None) -> EnvVar:
    """Register a variable (idempotent for an identical declaration) and return its reader."""
    if type not in _TYPES:
        raise TypeError(f"environment variable {name}: type must be one of bool, int, float, str, list")
    var = EnvVar(name, type, default, help, choices, section, ge, gt)
    old = _REGISTRY.get(name)
    if old is not None and old != var:
        raise ValueError(f"environment variable {name} declared twice, differently: {old} vs {var}")
    _REGISTRY[name] = var
    return var


def declared() -> list[EnvVar]:
    """Every variable declared so far (import the modules that declare them first), core first."""
    return sorted(_REGISTRY.values(), key=lambda v: (v.section != "core", v.section, v.name))


def cache_root() -> Path:
    """`$POLYRUNNER_CACHE`, else `$XDG_CACHE_HOME/polyrunner`, else `~/.cache/polyrunner`."""
    if CACHE.is_set():
        return Path(CACHE.get()).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "polyrunner"


CACHE = declare("POLYRUNNER_CACHE", str, "~/.cache/polyrunner",
                "cache folder: converted GGUF models, compiled CPU kernels (default: "
                "`$XDG_CACHE_HOME/polyrunner` when XDG_CACHE_HOME is set)")
LOGGING_LEVEL = declare("POLYRUNNER_LOGGING_LEVEL", str, "info",
                        "log level of every subcommand when --log-level is not given (unset: info; "
                        "warning for `conformance`)",
                        choices=("critical", "error", "warning", "info", "debug"))
ENGINE_PROCESS = declare("POLYRUNNER_ENGINE_PROCESS", bool, False,
                         "`AsyncLLM` (and `serve`) runs the engine in its own process when "
                         "`engine_process` is not given")
TP_TIMEOUT_S = declare("POLYRUNNER_TP_TIMEOUT_S", float, 600.0,
                       "seconds a tensor-parallel collective (start-up rendezvous included) may wait "
                       "before it fails", gt=0)
GRAMMAR_COMPILE_TIMEOUT_S = declare("POLYRUNNER_GRAMMAR_COMPILE_TIMEOUT_S", float, 10.0,
                                    "default `grammar_compile_timeout_s`: seconds a structured-output "
                                    "request may wait for its grammar", gt=0)
