"""Progress of long start-up steps (GGUF conversion, weight loading) for a person watching.

A step logs what it does and how long it took at INFO; `progress` adds a tqdm bar on
stderr for its long loop, but only where those INFO lines are shown (the CLI configures
logging at INFO, `polyrunner.logging_setup`) and stderr is a terminal (tqdm's
`disable=None`): library use with logging left unconfigured stays silent, and logs
redirected to a file get the lines without a bar's carriage returns.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], logger: logging.Logger, desc: str, total: int | None = None,
             unit: str = "tensor") -> Iterator[T]:
    """`items`, with a tqdm bar on stderr when `logger` shows INFO and stderr is a terminal."""
    if not logger.isEnabledFor(logging.INFO):
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    with tqdm(items, desc=desc, total=total, unit=unit, disable=None, leave=False) as bar:
        yield from bar
