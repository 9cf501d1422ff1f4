"""Grammars compiled off the engine's step, in a pool of worker threads (as
vLLM's StructuredOutputManager does): xgrammar releases the GIL while it parses
a schema and compiles it, so the step thread runs on meanwhile.

    pool = GrammarCompilePool(compiler, timeout_s)
    grammar = pool.submit(rid, params)   # the grammar at once when cached, else None
    ready, failed = pool.poll()          # each step: [(rid, grammar)], [(rid, ValueError)]
    pool.cancel(rid)                     # aborted: its compile is cancelled, or its result dropped
    grammar = pool.result(rid)           # block for it instead (offline admission)
    pool.wait(seconds)                   # sleep until a compile ends (nothing else to run)

`compiler` has `compile(params) -> grammar` (called in a worker) and
`lookup(params.key()) -> grammar | None` (its cache, called by `submit`), as
`polyrunner.structured.compiler.GrammarCompiler` has. Requests with the same
constraint (`params.key()`) share one compile. A request waits at most
`timeout_s` from `submit`, queueing included. Every failure is a ValueError
naming `structured_outputs.<kind>` — an invalid constraint, one nested too
deeply (RecursionError), any other compile error, the time limit — the
request's own fault, which the server answers with 400.

A compile cannot be interrupted: one still running when nobody waits for it
any more runs to its end on its worker (its grammar still lands in the
compiler's cache, and a new request with the same constraint joins it); the
pool's size bounds the CPU such compiles take. Workers are daemon threads, so
a runaway compile never holds up the process's exit. Not thread-safe: one
thread (the engine's) calls the pool.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any, Protocol

from polyrunner.structured.params import StructuredOutputsParams, too_deep

logger = logging.getLogger(__name__)

Key = tuple[str, str]
TIMEOUT_HINT = "grammar_compile_timeout_s, env POLYRUNNER_GRAMMAR_COMPILE_TIMEOUT_S"


class Compiler(Protocol):
    def compile(self, params: StructuredOutputsParams) -> Any: ...

    def lookup(self, key: Key) -> Any | None: ...


def default_workers() -> int:
    """Half the host's cores (vLLM's choice), at least 2 so one slow compile does
    not hold up every other, at most 8."""
    return max(2, min(8, ((os.cpu_count() or 2) + 1) // 2))


def request_error(exc: BaseException, kind: str) -> ValueError:
    """A compile's exception as the request's ValueError naming its field."""
    if isinstance(exc, ValueError):
        return exc
    if isinstance(exc, RecursionError):
        return too_deep(kind)
    return ValueError(f"structured_outputs.{kind}: the grammar failed to compile ({type(exc).__name__}: {exc})")


class _DaemonWorkers:
    """`n` daemon threads running submitted calls into `Future`s (cancellable until
    they start)."""

    def __init__(self, n: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:   # noqa: BLE001 - the waiter gets it
                future.set_exception(exc)
            else:
                future.set_result(result)
            del item, future, fn, args

    def shutdown(self) -> None:
        """Cancel the queued calls; the threads end after their current one."""
        try:
            while True:
                item = self._queue.get_nowait()
                if item is not None:
                    item[0].cancel()
        except queue.Empty:
            pass
        for _ in self._threads:
            self._queue.put(None)


class _Job:
    """One compile and the requests waiting for it."""

    __slots__ = ("future", "kind", "waiters")

    def __init__(self, future: Future, kind: str) -> None:
        self.future = future
        self.kind = kind
        self.waiters: set[str] = set()


class GrammarCompilePool:
    """Compiles grammars in worker threads, per request, under a time limit; see the module doc."""

    def __init__(self, compiler: Compiler, timeout_s: float, max_workers: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.compiler = compiler
        self.timeout_s = timeout_s
        self._clock = clock
        self._workers = _DaemonWorkers(max_workers or default_workers(), "grammar-compile")
        weakref.finalize(self, self._workers.shutdown)
        self._jobs: dict[Key, _Job] = {}                    # running or queued compiles, and finished ones
        self._pending: dict[str, tuple[Key, float]] = {}    # request id -> (key, deadline), oldest first
        self._orphans: set[Key] = set()                     # still running, nobody waiting
        self._changed = threading.Event()                   # a compile ended since the last poll

    @property
    def num_pending(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._pending)

    @property
    def num_jobs(self) -> int:
        """Compiles the pool still tracks (running, queued, or done and not yet collected)."""
        return len(self._jobs)

    def submit(self, request_id: str, params: StructuredOutputsParams) -> Any | None:
        """The compiled grammar of `params` when the compiler has it cached; else start
        its compile (or join the same constraint's) and return None: `poll` or
        `result` reports it. ValueError: a constraint that cannot even be keyed
        (nested too deeply), or `request_id` already waiting."""
        if request_id in self._pending:
            raise ValueError(f"request_id {request_id!r} is already waiting for its grammar")
        key = params.key()
        hit = self.compiler.lookup(key)
        if hit is not None:
            return hit
        job = self._jobs.get(key)
        if job is None:
            future = self._workers.submit(self.compiler.compile, params)
            job = self._jobs[key] = _Job(future, params.kind)
            future.add_done_callback(lambda _: self._changed.set())
        self._orphans.discard(key)
        job.waiters.add(request_id)
        self._pending[request_id] = (key, self._clock() + self.timeout_s)
        return None

    def poll(self) -> tuple[list[tuple[str, Any]], list[tuple[str, ValueError]]]:
        """Requests whose grammar is ready, and requests that failed (invalid, or over
        the time limit), since the last call; both leave the pool. Cheap when
        nothing ended and no deadline passed."""
        if not self._pending:
            self._reap()
            return [], []
        now = self._clock()
        first_deadline = next(iter(self._pending.values()))[1]
        if not self._changed.is_set() and now < first_deadline:
            return [], []
        self._changed.clear()
        ready: list[tuple[str, Any]] = []
        failed: list[tuple[str, ValueError]] = []
        for rid, (key, deadline) in list(self._pending.items()):
            job = self._jobs[key]
            if job.future.done():
                grammar, error = self._outcome(job)
            elif now >= deadline:
                grammar, error = None, self._timeout(rid, job)
            else:
                continue
            self._forget(rid)
            if error is None:
                ready.append((rid, grammar))
            else:
                failed.append((rid, error))
        self._reap()
        return ready, failed

    def result(self, request_id: str) -> Any:
        """Block until `request_id`'s grammar is ready (returned) or fails (ValueError,
        the time limit included); either way it leaves the pool."""
        key, deadline = self._pending[request_id]
        job = self._jobs[key]
        try:
            job.future.exception(timeout=max(0.0, deadline - self._clock()))
        except (TimeoutError, CancelledError):
            pass
        grammar, error = self._outcome(job) if job.future.done() else (None, self._timeout(request_id, job))
        self._forget(request_id)
        if error is not None:
            raise error
        return grammar

    def cancel(self, request_id: str) -> None:
        """`request_id` no longer waits: its compile is cancelled if nobody else waits
        for it and it has not started, else its result is dropped for this request."""
        if request_id in self._pending:
            self._forget(request_id)

    def wait(self, timeout: float) -> None:
        """Sleep until a compile ends, the first deadline passes, or `timeout` seconds."""
        if self._pending:
            first_deadline = next(iter(self._pending.values()))[1]
            timeout = min(timeout, max(0.0, first_deadline - self._clock()))
        self._changed.wait(timeout)

    def shutdown(self) -> None:
        """Cancel the queued compiles and let the workers end (running ones finish first)."""
        self._workers.shutdown()

    # ---- internals ------------------------------------------------------------------
    def _outcome(self, job: _Job) -> tuple[Any, ValueError | None]:
        future = job.future
        if future.cancelled():
            return None, ValueError(f"structured_outputs.{job.kind}: the grammar compile was cancelled "
                                    "(the engine is shutting down)")
        exc = future.exception()
        return (future.result(), None) if exc is None else (None, request_error(exc, job.kind))

    def _timeout(self, request_id: str, job: _Job) -> ValueError:
        logger.warning("request %s: its grammar did not compile within %g s (%s)", request_id, self.timeout_s,
                       "still running: it runs on in its worker" if job.future.running() else "queued")
        return ValueError(f"structured_outputs.{job.kind}: the grammar did not compile within {self.timeout_s:g} s "
                          f"(the limit is {TIMEOUT_HINT}); a smaller or less deeply nested constraint "
                          "compiles faster")

    def _forget(self, request_id: str) -> None:
        key, _ = self._pending.pop(request_id)
        job = self._jobs[key]
        job.waiters.discard(request_id)
        if job.waiters:
            return
        if job.future.done() or job.future.cancel():
            del self._jobs[key]
        else:   # running: it cannot be stopped; a later request with this constraint may join it
            self._orphans.add(key)

    def _reap(self) -> None:
        """Forget orphaned compiles that have ended (their grammar is in the compiler's cache)."""
        if self._orphans:
            for key in [k for k in self._orphans if self._jobs[k].future.done()]:
                self._orphans.discard(key)
                del self._jobs[key]
