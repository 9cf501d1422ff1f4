"""An engine core in a background thread of the caller's process.

The engine is not thread-safe, so exactly one thread — this one — touches it;
commands arrive through a `ThreadInbox`. Cheap to start and easy to inspect
(`.engine`), but the engine shares the GIL with the caller: a busy asyncio
server and the engine slow each other down. `EngineProcess` avoids that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from polyrunner.engine.engine_loop import Command, CoreCounts, CoreInfo, EngineLoop, Event, ThreadInbox

if TYPE_CHECKING:
    from polyrunner.engine.llm_engine import LLMEngine

ReportFn = Callable[[list[Event], CoreCounts], None]
DeadFn = Callable[[BaseException], None]


class EngineThread:
    """Runs `EngineLoop` over `engine` in a daemon thread; calls `on_report` after
    every loop turn and `on_dead(exc)` if the loop raises (both in that thread)."""

    def __init__(self, engine: LLMEngine, on_report: ReportFn, on_dead: DeadFn) -> None:
        self.engine = engine
        self.info = CoreInfo.of(engine)
        self._inbox = ThreadInbox()
        self._loop = EngineLoop(engine, self._inbox, on_report)
        self._on_dead = on_dead
        self.initial_counts = self._loop.counts()
        self._thread = threading.Thread(target=self._run, name="polyrunner-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as exc:   # noqa: BLE001 - every pending request must hear of it
            self._on_dead(exc)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, commands: list[Command]) -> None:
        self._inbox.put(commands)

    def stop(self) -> None:
        """Abort what is left, end the loop, wait for the thread, shut the engine down."""
        if self._thread.is_alive():
            self._inbox.put([("stop",)])
            self._thread.join()
        self.engine.shutdown()
