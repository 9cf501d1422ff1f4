"""One logging setup for every entry point: `--log-level`, else POLYRUNNER_LOGGING_LEVEL, else info."""

from __future__ import annotations

import logging

from polyrunner import envs

__all__ = ["LOG_LEVELS", "configure_logging", "resolve_level"]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
_DATEFMT = "%H:%M:%S"


def resolve_level(level: str | int | None = None, default: str = "info") -> int:
    """The numeric level: the argument when given, else the environment variable, else `default`."""
    if level is None:
        level = envs.LOGGING_LEVEL.get() if envs.LOGGING_LEVEL.is_set() else default
    if isinstance(level, int):
        return level
    if level.lower() not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LOG_LEVELS)}")
    return getattr(logging, level.upper())


def configure_logging(level: str | int | None = None, default: str = "info") -> int:
    """Send polyrunner's log records to stderr at `level` (None: POLYRUNNER_LOGGING_LEVEL,
    else `default`); returns the numeric level.

    Only the `polyrunner` logger is configured (a handler of its own, no propagation to
    the root), so an application embedding polyrunner keeps its own logging untouched.
    Calling it again changes the level and never adds a second handler.
    """
    numeric = resolve_level(level, default)
    logger = logging.getLogger("polyrunner")
    logger.setLevel(numeric)
    if not any(getattr(h, "_polyrunner", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
        handler._polyrunner = True   # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    return numeric
