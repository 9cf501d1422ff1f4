"""An engine core in its own process (vLLM's EngineCore shape).

The frontend process (the HTTP server, tokenization, streaming) and the engine
then never share a GIL: a busy server cannot stall a step, and the engine's
Python work cannot stall the server. They talk over one duplex pipe:

    frontend -> engine   lists of commands (see `engine_loop`)
    engine -> frontend   ("ready", CoreInfo) or ("failed", why) once at start,
                         ("report", events, CoreCounts) after every loop turn,
                         ("dead", why) if the loop raised, ("stopped",) at the end

Outputs travel as deltas (`output_deltas`): each report carries only what is
new since the last one. The process is started with "spawn" (safe with
threads and every device runtime) and ignores SIGINT: its frontend decides
when it stops. If the frontend dies, the pipe closes and the engine exits at
its next loop turn; if the engine dies, the frontend's reader sees the pipe
close and reports the engine dead.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import queue
import signal
import threading
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from polyrunner.engine.engine_loop import Command, CoreCounts, CoreInfo, EngineLoop, Event
from polyrunner.engine.output_deltas import DeltaDecoder, DeltaEncoder

if TYPE_CHECKING:
    from polyrunner.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

ReportFn = Callable[[list[Event], CoreCounts], None]
DeadFn = Callable[[BaseException], None]
MakeEngine = Callable[[dict[str, Any]], "LLMEngine"]
STOP_TIMEOUT_S = 30.0


class EngineProcessError(RuntimeError):
    """The engine process failed to start or died."""


class EngineProcess:
    """Starts `LLM(**llm_kwargs)`'s engine in a child process and relays it.

    The constructor returns once the engine is ready (or raises
    `EngineProcessError` with the child's error). `on_report` / `on_dead` run in
    a reader thread of this process."""

    def __init__(self, llm_kwargs: dict[str, Any], on_report: ReportFn, on_dead: DeadFn,
                 make_engine: MakeEngine, share: tuple[int, int] | None = None) -> None:
        """`make_engine(llm_kwargs)` builds the engine in the child (`polyrunner.llm.engine_of`;
        module level: it pickles by reference). `share=(replica, replicas)`: a data-parallel
        replica, which takes its share of the host first (`replica_share.take_share`)."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        # not a daemon: a daemon may not start processes, and tensor-parallel workers are
        # the engine's children. At exit `_stop_at_exit` stops it (or it sees the pipe close).
        name = "polyrunner-engine" if share is None else f"polyrunner-engine-dp{share[0]}"
        self.process = ctx.Process(target=_child_main, name=name,
                                   args=(child_conn, llm_kwargs, logging.getLogger("polyrunner").getEffectiveLevel(),
                                         make_engine, share))
        self.process.start()
        child_conn.close()
        atexit.register(_stop_at_exit, weakref.ref(self))
        self._outq: queue.SimpleQueue[list[Command] | None] = queue.SimpleQueue()
        self._stopping = False
        self._on_report, self._on_dead = on_report, on_dead
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            kind, payload = "failed", None
        if kind != "ready":
            self._stopping = True
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            raise EngineProcessError(f"the engine process failed to start (exit code {self.process.exitcode})"
                                     + (f": {payload}" if payload else ""))
        self.info: CoreInfo = payload[0]
        self.initial_counts: CoreCounts = payload[1]
        self._reader = threading.Thread(target=self._read, name="polyrunner-engine-reader", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send, name="polyrunner-engine-sender", daemon=True)
        self._sender.start()

    @property
    def alive(self) -> bool:
        return self.process.is_alive() and self._reader.is_alive()

    def submit(self, commands: list[Command]) -> None:
        """Queue commands for the engine; never blocks (a sender thread writes the
        pipe, which fills while the engine is busy with a step). A dead engine is
        reported by the reader, not here."""
        self._outq.put(commands)

    def _send(self) -> None:
        q = self._outq
        while True:
            commands = q.get()
            if commands is None:
                return
            while not q.empty():   # everything queued meanwhile goes in one message
                more = q.get()
                if more is None:
                    q.put(None)
                    break
                commands = commands + more
            try:
                self._conn.send(commands)
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                return

    def stop(self) -> None:
        """Abort what is left, let the process exit, and reap it (killed if it hangs)."""
        if self._stopping:
            return
        self._stopping = True
        self.submit([("stop",)])
        self._outq.put(None)
        self._sender.join(STOP_TIMEOUT_S)
        self._reader.join(STOP_TIMEOUT_S)
        self.process.join(STOP_TIMEOUT_S if self.process.is_alive() else 0)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            self.process.kill()
            self.process.join()
        self._conn.close()

    def _read(self) -> None:
        decoder = DeltaDecoder()
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "report":
                    self._on_report(_decoded(msg[1], decoder), msg[2])
                elif msg[0] == "dead":
                    self.process.join(timeout=10)
                    self._on_dead(EngineProcessError(msg[1]))
                    return
                elif msg[0] == "stopped":
                    return
        except (EOFError, OSError):
            if self._stopping:
                return
            self.process.join(timeout=10)
            self._on_dead(EngineProcessError(f"the engine process exited unexpectedly "
                                             f"(exit code {self.process.exitcode})"))
        except BaseException as exc:   # noqa: BLE001 - a frontend bug must not leave requests hanging
            self._on_dead(exc)


def _stop_at_exit(ref: weakref.ref[EngineProcess]) -> None:
    core = ref()
    if core is not None and core.process.is_alive():
        core.stop()


def _decoded(events: list[Event], decoder: DeltaDecoder) -> list[Event]:
    out = []
    for event in events:
        if event[0] == "outputs":
            event = ("outputs", [decoder.decode(d) for d in event[1]])
        elif event[0] != "reply":
            decoder.forget(event[1])
        out.append(event)
    return out


# ---- the child ----------------------------------------------------------------------
class _PipeInbox:
    """Commands from the frontend; a closed pipe (the frontend died) reads as "stop"."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def take(self, block: bool) -> list[Command]:
        conn, items = self.conn, []
        try:
            if block or conn.poll(0):
                items.extend(conn.recv())
                while conn.poll(0):
                    items.extend(conn.recv())
        except (EOFError, OSError):
            items.append(("stop",))
        return items


def _child_main(conn: Connection, llm_kwargs: dict[str, Any], log_level: int, make_engine: MakeEngine,
                share: tuple[int, int] | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the frontend decides when the engine stops
    from polyrunner.logging_setup import configure_logging
    configure_logging(log_level)   # the frontend's level for polyrunner's records
    try:
        if share is not None:
            from polyrunner.engine.replica_share import take_share
            take_share(llm_kwargs, *share)
        engine = make_engine(llm_kwargs)   # the heavy imports happen in the child only
    except BaseException as exc:   # noqa: BLE001 - the frontend shows why
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    encoder = DeltaEncoder()

    def report(events: list[Event], counts: CoreCounts) -> None:
        wire = []
        for event in events:
            if event[0] == "outputs":
                event = ("outputs", encoder.encode(event[1]))
            elif event[0] != "reply":
                encoder.forget(event[1])
            wire.append(event)
        conn.send(("report", wire, counts))

    loop = EngineLoop(engine, _PipeInbox(conn), report)
    conn.send(("ready", (CoreInfo.of(engine), loop.counts())))
    try:
        loop.run()
    except (BrokenPipeError, ConnectionResetError):
        return   # the frontend is gone
    except BaseException as exc:   # noqa: BLE001
        logger.error("the engine loop died\n%s", traceback.format_exc())
        _send_quietly(conn, ("dead", f"{type(exc).__name__}: {exc}"))
        return
    finally:
        engine.shutdown()
    _send_quietly(conn, ("stopped",))


def _send_quietly(conn: Connection, msg: tuple[Any, ...]) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass
