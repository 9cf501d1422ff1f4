"""Which processes a test left behind (Linux /proc)."""

from __future__ import annotations

import os
import time


def children() -> set[int]:
    """Live child processes of this one, except multiprocessing's resource tracker
    (started once per process by the first spawn; not ours to stop)."""
    me, found = str(os.getpid()), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z" and b"resource_tracker" not in cmdline:
                found.add(int(entry))
    return found


def gone(pid: int, timeout: float) -> bool:
    """True once process `pid` no longer exists (waits up to `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
