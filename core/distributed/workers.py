"""Tensor-parallel processes: the driver (rank 0, which owns the scheduler)
and its workers (ranks 1..N-1, which only run the model).

    driver                                   worker r
    start_workers(): spawn ranks 1..N-1      worker_main(): select the backend,
      (or torchrun started them)               pick its device (`init_rank`)
    init_tensor_parallel (rendezvous)  <-->  init_tensor_parallel
    load its shard, size the KV cache  <-->  load its shard, size the KV cache
      (every rank takes the smallest)
    each step: broadcast the step      --->  runner.execute(step)   (same tokens:
      then run it                              same logits, seeds and sampler; the
                                               step names the finished slots)
    shutdown: broadcast "stop", join   --->  leave the loop, destroy the group

Faults: a worker that raises sends its error on its pipe and exits; one that
dies closes its sockets. Either way the driver's next collective fails, and the
driver raises `TensorParallelError` naming the rank (its message or exit code).
Workers are daemons of the driver, and a worker whose driver vanished fails its
next collective and exits: no process outlives the engine.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from polyrunner.distributed.group import TensorParallel
from polyrunner.distributed.step_message import decode_step, encode_step, encode_stop
from polyrunner.step_channel import SchedulerOutput

logger = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 30.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the message names it."""


def free_tcp_init_method() -> str:
    """A tcp:// rendezvous on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@dataclass
class WorkerHandles:
    """The driver's view of the workers it spawned (empty under torchrun)."""

    processes: dict[int, multiprocessing.Process] = field(default_factory=dict)
    errors: dict[int, Connection] = field(default_factory=dict)

    def failure(self, wait_s: float = 5.0) -> str | None:
        """Which worker failed and how ("rank 1: ValueError: ..." or "rank 1 died
        (exit code -9)"), waiting up to `wait_s` for a dying one; None if none did."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, conn in self.errors.items():
                if conn.poll(0):
                    try:
                        return f"rank {rank}: {conn.recv()}"
                    except (EOFError, OSError):
                        pass
            for rank, proc in self.processes.items():
                if not proc.is_alive():
                    return f"rank {rank} died (exit code {proc.exitcode})"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def join(self) -> None:
        for proc in self.processes.values():
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.errors.values():
            conn.close()


def start_workers(size: int, init_method: str, config: dict[str, Any], timeout_s: float = 300.0) -> WorkerHandles:
    """Spawn ranks 1..size-1 on this host (with the plugins registered in this
    process's code); returns once each has imported and validated its
    configuration (a worker that cannot start fails fast here)."""
    from polyrunner.plugins.manager import runtime_plugins
    plugins = runtime_plugins()
    ctx = multiprocessing.get_context("spawn")
    handles = WorkerHandles()
    for rank in range(1, size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker_main, name=f"polyrunner-tp{rank}", daemon=True,
                           args=(rank, size, rank, init_method, config, child, plugins,
                                 logging.getLogger("polyrunner").getEffectiveLevel()))
        proc.start()
        child.close()
        handles.processes[rank], handles.errors[rank] = proc, parent
    deadline = time.monotonic() + timeout_s
    for rank, conn in handles.errors.items():
        while not conn.poll(0.1):
            if not handles.processes[rank].is_alive() or time.monotonic() > deadline:
                handles.join()
                why = handles.failure(0) or f"rank {rank} did not start within {timeout_s:.0f} s"
                raise TensorParallelError(f"tensor-parallel worker failed to start: {why}")
        message = conn.recv()
        if message != "started":   # the worker's error
            handles.join()
            raise TensorParallelError(f"tensor-parallel worker failed to start: rank {rank}: {message}")
    return handles


class TPDriver:
    """Rank 0: sends every step to the workers before running it, and turns a
    failed collective into an error naming the failed rank."""

    def __init__(self, tp: TensorParallel, workers: WorkerHandles) -> None:
        self.tp = tp
        self.workers = workers
        self._stopped = False

    def send_step(self, so: SchedulerOutput) -> None:
        self.guarded(lambda: self.tp.broadcast_bytes(encode_step(so)))

    def guarded(self, fn: Callable[[], Any]) -> Any:
        """`fn()`, with a failed collective reported as the failed rank's error."""
        try:
            return fn()
        except Exception as exc:   # noqa: BLE001 - gloo/nccl raise RuntimeError (or DistBackendError)
            why = self.workers.failure()
            if why is None:
                raise
            raise TensorParallelError(f"tensor-parallel worker failed: {why}") from exc

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        failed = True
        try:
            if self.workers.failure(0) is None:
                self.tp.broadcast_bytes(encode_stop())
                failed = False
        except Exception:   # noqa: BLE001 - a broken group: the workers exit on their own
            logger.debug("stop broadcast failed", exc_info=True)
        # the workers' last step after "stop" is the barrier in `destroy`: meet them there
        # before waiting for them to exit (the other order waits JOIN_TIMEOUT_S)
        self.tp.destroy(synced=not failed)
        self.workers.join()


class TPDriverRunner:
    """The driver's runner: every step goes to the workers first. Everything else
    reads through to the wrapped `ModelRunner`."""

    def __init__(self, runner, driver: TPDriver) -> None:
        self.runner = runner
        self.driver = driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def execute(self, so: SchedulerOutput):
        self.driver.send_step(so)
        return self.driver.guarded(lambda: self.runner.execute(so))



def serve_steps(tp: TensorParallel, runner) -> None:
    """A worker's loop: run what the driver sends until it says stop."""
    while True:
        so = decode_step(tp.broadcast_bytes(None))
        if so is None:
            return
        runner.execute(so)


def worker_main(rank: int, size: int, local_rank: int, init_method: str, config: dict[str, Any],
                errors: Connection | None, plugins: dict[str, Any] | None = None,
                log_level: int | None = None) -> None:
    """A spawned worker process (also the body of a torchrun rank > 0); `log_level`: the
    driver's level for polyrunner's records (None: logging left as the process has it)."""
    if log_level is not None:
        from polyrunner.logging_setup import configure_logging
        configure_logging(log_level)
    from polyrunner.engine.model_setup import build_tp_rank  # heavy imports in the worker only
    from polyrunner.plugins.manager import register_runtime_plugins

    try:
        register_runtime_plugins(plugins or {})
        built = build_tp_rank(config, rank, size, local_rank, init_method,
                              started=(lambda: errors.send("started")) if errors is not None else None)
    except BaseException as exc:   # noqa: BLE001
        _report(errors, rank, exc)
        os._exit(1)
    try:
        serve_steps(built.tp, built.runner)
    except BaseException as exc:   # noqa: BLE001 - the driver's collective fails and reads this
        _report(errors, rank, exc)
        os._exit(1)
    built.tp.destroy()


def _report(errors: Connection | None, rank: int, exc: BaseException) -> None:
    logger.error("tensor-parallel rank %d failed\n%s", rank, traceback.format_exc())
    if errors is not None:
        try:
            errors.send(f"{type(exc).__name__}: {exc}")
        except OSError:
            pass
