"""Which processes a test left behind (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


@contextlib.contextmanager
def serve_process(*args: str, timeout: float = 120) -> Iterator[tuple[subprocess.Popen, str]]:
    """`polyrunner serve --port P *args` in a subprocess (stdout and stderr merged,
    text), yielded with its base URL once `/health` answers 200; killed on exit
    if it still runs."""
    import httpx
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "polyrunner", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
