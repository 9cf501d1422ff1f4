"""Run an app with uvicorn; SIGINT / SIGTERM shut it down gracefully and exit 0.

On a signal uvicorn stops accepting connections and lets the open ones finish.
First, though, the app hears of it (`app.state.drain()`, when the app has one):
calls still open after `shutdown_timeout` seconds end there with an error the
client reads (a stream: an error event, then `data: [DONE]`). uvicorn's own
limit, a few seconds later, only cancels what is stuck (a client that stopped
reading). Then the app's lifespan shutdown stops the AsyncLLM. Afterwards
uvicorn re-raises the signal it caught so the process dies of it; here that
signal is ignored instead, so a graceful shutdown exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
CANCEL_AFTER_S = 5.0   # uvicorn cancels what is still open this long after the app's own shutdown timeout


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when its shutdown begins."""

    def __init__(self, config: uvicorn.Config, app) -> None:
        super().__init__(config)
        self._app = app

    async def shutdown(self, sockets=None) -> None:
        drain = getattr(getattr(self._app, "state", None), "drain", None)
        if drain is not None:
            drain()
        await super().shutdown(sockets)


def make_server(app, host: str = "127.0.0.1", port: int = 8000, *, shutdown_timeout: float | None = 30.0,
                log_level: str = "info", access_log: bool = False) -> uvicorn.Server:
    """A uvicorn server for `app`; `shutdown_timeout`: how long open calls may go on after a signal
    (the app ends them, see the module docstring; None: no limit)."""
    cancel_after = None if shutdown_timeout is None else shutdown_timeout + CANCEL_AFTER_S
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            lifespan="on", timeout_graceful_shutdown=cancel_after,
                            timeout_keep_alive=5)
    return _Server(config, app)


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
