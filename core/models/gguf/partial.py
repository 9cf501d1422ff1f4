"""Who owns a conversion's `.partial` folder, so that a dead owner's is reclaimed.

A conversion writes into `.<entry>.<random>.partial` in the cache and renames
it into place when done. A process killed mid-way (SIGKILL, the OOM killer)
leaves the folder behind. `claim` records the owner in it: pid, the process's
start time and the boot id (a reused pid is not taken for the owner), the host
and pid namespace (the cache may be shared with other machines or containers). At the next conversion
`reclaim_abandoned` deletes the folders whose owner is gone and leaves those of
live owners alone. A folder without a readable owner record (written before
records existed, or by another host) is deleted once a day old, as before.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

OWNER_FILE = ".owner.json"
UNKNOWN_OWNER_AGE_S = 86400   # how old a partial folder with no usable owner record must be to go


def this_process() -> dict[str, Any]:
    """The owner record of the running process."""
    return {"pid": os.getpid(), "start_time": _start_time(os.getpid()), "boot_id": _boot_id(),
            "pid_namespace": _pid_namespace(), "host": socket.gethostname()}


def claim(folder: Path) -> None:
    """Record the running process as the owner of the partial folder `folder`."""
    tmp = folder / f"{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(this_process()))
    os.replace(tmp, folder / OWNER_FILE)   # a reader sees the whole record or none


def release(folder: Path) -> None:
    """Drop the owner record before the finished folder is renamed into place."""
    (folder / OWNER_FILE).unlink(missing_ok=True)


def owner_alive(owner: dict[str, Any]) -> bool | None:
    """Whether the process of an owner record still runs; None: cannot tell (another host)."""
    me = this_process()
    if owner.get("host") != me["host"] or owner.get("pid_namespace") != me["pid_namespace"]:
        return None   # its pids are not ours to look up
    if owner.get("boot_id") is not None and owner.get("boot_id") != me["boot_id"]:
        return False   # rebooted since: every process of then is gone
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # runs, as another user
    proc = _proc_stat(pid)   # None where /proc is missing or hides the process: the pid check must do
    if proc is not None:
        state, started = proc
        recorded = owner.get("start_time")
        if state in ("Z", "X") or (recorded is not None and started != recorded):
            return False   # exited (a zombie), or the pid was reused by another process
    return True


def is_abandoned(folder: Path, now: float | None = None) -> bool:
    """A partial folder whose owner is gone (or, without a usable record, a day old)."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        owner = None
    alive = owner_alive(owner) if isinstance(owner, dict) else None
    if alive is not None:
        return not alive
    try:
        return (now or time.time()) - folder.stat().st_mtime > UNKNOWN_OWNER_AGE_S
    except OSError:
        return False   # gone already


def reclaim_abandoned(folders: Iterable[Path]) -> list[Path]:
    """Delete the abandoned ones of `folders`; returns them."""
    gone = [f for f in folders if is_abandoned(f)]
    for f in gone:
        shutil.rmtree(f, ignore_errors=True)
    return gone


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """The process's state letter and start time (clock ticks since boot) from Linux /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) "; comm may hold spaces
    return fields[0], int(fields[19])   # fields 3 and 22 of proc(5)


def _start_time(pid: int) -> int | None:
    proc = _proc_stat(pid)
    return None if proc is None else proc[1]


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
