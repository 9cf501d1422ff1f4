"""Resident memory of a process and its descendants, from /proc (no psutil): for the benchmark
workers, which run in foreign venvs (vLLM, llama.cpp) and import this file from their own folder.

`LoadMeter` times an engine's start-up (the `LLM(...)` / model-load call) and samples the resident
memory of the worker's process tree every 20 ms while it runs: vLLM's engine core is a child process.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_pids(root: int | None = None) -> list[int]:
    """`root` (default: this process) and every descendant alive now."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_rss() -> int:
    """Bytes resident in this process tree now (sum of VmRSS: pages two processes share count twice)."""
    return 1024 * sum(_status_kb(p, "VmRSS") for p in tree_pids())


def tree_hwm() -> int:
    """Sum of every process's peak resident set (VmHWM) in this tree."""
    return 1024 * sum(_status_kb(p, "VmHWM") for p in tree_pids())


class LoadMeter:
    """`with LoadMeter() as m: llm = LLM(...)`: m.stats() -> start-up seconds, resident bytes after the
    load and the peak sampled during it (the larger of the sampled tree sum and the tree's VmHWM)."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss())
            self._stop.wait(self.period_s)

    def __enter__(self) -> "LoadMeter":
        self.rss_before = tree_rss()
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.start_s = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.rss_after_load = tree_rss()
        self.peak = max(self.peak, self.rss_after_load, tree_hwm())

    def stats(self) -> dict[str, Any]:
        return dict(start_s=self.start_s, rss_before_load=self.rss_before, rss_after_load=self.rss_after_load,
                    peak_load=self.peak)


def end_stats() -> dict[str, Any]:
    """Resident memory at the end of a worker's runs, and the tree's peak (VmHWM sum) over its life."""
    return dict(rss_end=tree_rss(), peak_end=tree_hwm())
