"""A request's CPU work (body validation, tokenization, chat templates) off the event loop.

`Offload.run(fn, *args, cost=n)` calls `fn` inline while `cost` (bytes or
characters of input) is small, and otherwise in a small thread pool of its own
(`Offload.thread(fn, *args)`: always there),
so one large body or prompt never stalls /health or the other streams. The
tokenizer releases the GIL while it encodes (`Tokenizer.encode_batch`); Python
work in the pool (pydantic errors, jinja) shares the GIL with the loop in
short slices.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

INLINE_MAX_COST = 16 << 10   # below this many bytes / characters the work takes well under a millisecond


class Offload:
    """A thread pool for request work; `close()` when the app stops."""

    def __init__(self, max_workers: int | None = None) -> None:
        workers = max_workers or min(4, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="polyrunner-serve")

    async def run(self, fn: Callable[..., T], *args: Any, cost: int) -> T:
        """`fn(*args)`: inline when `cost <= INLINE_MAX_COST`, else in the pool. Its exceptions propagate."""
        if cost <= INLINE_MAX_COST:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def thread(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the pool, whatever it costs (disk reads: an adapter's files)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
