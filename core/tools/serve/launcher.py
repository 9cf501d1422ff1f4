"""Run an app with uvicorn; SIGINT / SIGTERM shut it down gracefully and exit 0.

On a signal uvicorn stops accepting connections, lets the open ones finish for
up to `shutdown_timeout` seconds (then cancels them, which aborts their engine
requests) and runs the app's lifespan shutdown, which drains and stops the
AsyncLLM. Afterwards uvicorn re-raises the signal it caught so the process dies
of it; here that signal is ignored instead, so a graceful shutdown exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def make_server(app, host: str = "127.0.0.1", port: int = 8000, *, shutdown_timeout: float | None = 30.0,
                log_level: str = "info", access_log: bool = False) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            lifespan="on", timeout_graceful_shutdown=shutdown_timeout,
                            timeout_keep_alive=5)
    return uvicorn.Server(config)


def run_server(server: uvicorn.Server, sock: socket.socket | None = None) -> int:
    """Serve until a signal (or `server.should_exit`); 0 after a graceful shutdown."""
    with _no_signal_reraise():
        server.run(sockets=[sock] if sock is not None else None)
    return 0 if server.started else 1


@contextlib.contextmanager
def _no_signal_reraise() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
