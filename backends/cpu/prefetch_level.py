"""A kernel's prefetch level, L1 or L2, chosen by timing both once per machine.

Into L1 (`prefetcht0`) every prefetch holds one of the core's few L1 miss buffers until its line
lands; into L2 (`prefetcht1`) the loads then hit L2 instead. Which is faster depends on the core
and on the kernel, so each kernel that prefetches what it streams from memory (`decode_prefetch.py`,
`linear_prefetch.py`) times both on data beyond the caches, caches the times next to the linears'
(`kernel_table.cached`) and runs the faster; an environment variable forces one.
"""

from __future__ import annotations

from collections.abc import Callable

from polyrunner.backends.cpu import kernel_table

LEVELS = ("l1", "l2")


def choose(what: str, forced: tuple[str, str], unavailable: str | None, key: str,
           timer: Callable[[], kernel_table.Times], threads: int, setter: Callable[[bool], object],
           per: str) -> str:
    """Set the level (`setter(True)`: L2) and return a line saying which and why: `forced` (the
    environment variable's (value, name): a value other than "auto" wins), nothing to choose
    (`unavailable`, the reason: L1), or the times under `key` in the kernel table (`timer()`'s,
    timed once per machine, {level: {_: us}}; `per`: what one time covers)."""
    value, env_name = forced
    if value != "auto":
        level, why = value, env_name
    elif unavailable is not None:
        level, why = "l1", unavailable
    else:
        times = kernel_table.cached(key, timer, threads=threads)
        us = {name: sum(t for t in times[name].values() if t is not None) for name in LEVELS}
        level = min(LEVELS, key=us.__getitem__)
        why = ", ".join(f"{name} {us[name]:.0f} us" for name in LEVELS) + f" {per}"
    setter(level == "l2")
    return f"{what} into {level.upper()} ({why})"
