"""N engine cores behind one frontend: data parallelism (vLLM's `data_parallel_size`).

`DPCores` starts N `EngineProcess`es — replica i runs `LLM(**llm_kwargs,
data_parallel_size=1)` (with its own tensor-parallel group when asked) on its
share of the host (`replica_share`), its engine built by `make_engine` — and looks to `AsyncLLM` like one core
(`info`, `initial_counts`, `alive`, `submit`, `stop`):

    submit  ("add", rid, prompt, ...)  -> the `Router`'s replica, remembered as the request's owner
            ("abort", rid)              -> its owner (unknown ids: dropped)
            ("call", id, method, args)  -> every live replica; their replies merge into one
            ("stop",)                   -> every replica
    report  each replica's report goes on as `on_report(events, total counts, replica)`,
            one at a time (replies held back until every live replica answered)
    death   a replica's death fails its own requests — one ("failed", rid,
            ReplicaDeadError) event each, naming the replica — and no request is
            routed to it again; the others keep serving. When the last one dies,
            `on_dead` runs as for a single core.

Load (for routing) = running + waiting from the replica's latest report, plus the
sequences routed to it that it had not taken yet.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from polyrunner.engine.core_errors import EngineDeadError, ReplicaDeadError
from polyrunner.engine.dp_router import NoReplicaError, Router
from polyrunner.engine.engine_loop import Command, CoreCounts, CoreInfo, Event, sequences
from polyrunner.engine.engine_process import EngineProcess, EngineProcessError, MakeEngine

ReportFn = Callable[[list[Event], CoreCounts, int | None], None]   # replica None: no replica's report
DeadFn = Callable[[BaseException], None]


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the frontend sees it (for /health and /metrics)."""

    index: int
    alive: bool
    counts: CoreCounts         # its latest report (zeros once it died)
    num_waiting: int           # its queue plus the requests routed to it not taken yet
    pid: int | None
    error: str | None = None   # why it died

    @property
    def num_running(self) -> int:
        return self.counts.num_running

    @property
    def load(self) -> int:
        return self.counts.num_running + self.num_waiting


@dataclass
class _Replica:
    index: int
    core: EngineProcess | None = None
    counts: CoreCounts = field(default_factory=CoreCounts)
    sent: int = 0                                   # sequences routed to it, cumulative
    owned: set[str] = field(default_factory=set)    # its unfinished requests
    error: str | None = None

    @property
    def waiting(self) -> int:
        return self.counts.num_waiting + max(0, self.sent - self.counts.adds_applied)


@dataclass
class _Call:
    method: str
    waiting: set[int]
    results: list[tuple[int, bool, Any]] = field(default_factory=list)


class DPCores:
    """`size` engine processes behind one frontend; see the module docstring."""

    def __init__(self, llm_kwargs: dict[str, Any], size: int, on_report: ReportFn, on_dead: DeadFn,
                 make_engine: MakeEngine, routing: str = "least_loaded") -> None:
        if size < 2:
            raise ValueError(f"data_parallel_size={size}: DPCores runs 2..64 replicas (1: one EngineProcess)")
        self.router = Router(routing, block_size=int(llm_kwargs.get("block_size") or 16))
        self._lock = threading.RLock()
        self._on_report, self._on_dead = on_report, on_dead
        self._replicas = [_Replica(i) for i in range(size)]
        self._owner: dict[str, int] = {}
        self._calls: dict[int, _Call] = {}
        self._stopping = False
        kwargs = {**llm_kwargs, "data_parallel_size": 1}
        with ThreadPoolExecutor(size, thread_name_prefix="polyrunner-dp-start") as pool:
            futures = [pool.submit(EngineProcess, kwargs, partial(self._report, i), partial(self._died, i),
                                   make_engine, (i, size))
                       for i in range(size)]
        errors = []
        for replica, future in zip(self._replicas, futures):
            try:
                replica.core = future.result()
                replica.counts = replica.core.initial_counts
            except EngineProcessError as exc:
                errors.append(f"replica {replica.index}: {exc}")
        if errors:
            self.stop()
            raise EngineProcessError("data-parallel replicas failed to start: " + "; ".join(errors))
        first = self._replicas[0].core
        assert first is not None
        self.info: CoreInfo = first.info
        self.initial_counts = self._total()

    # ---- what the frontend reads ----------------------------------------------------
    @property
    def size(self) -> int:
        return len(self._replicas)

    @property
    def alive(self) -> bool:
        """Some replica still serves."""
        return any(r.error is None and r.core is not None and r.core.alive for r in self._replicas)

    def states(self) -> list[ReplicaState]:
        with self._lock:
            return [ReplicaState(r.index, r.error is None and r.core is not None and r.core.alive, r.counts,
                                 r.waiting, None if r.core is None else r.core.process.pid, r.error)
                    for r in self._replicas]

    def owner(self, request_id: str) -> int | None:
        """The replica serving `request_id` (None: unknown or finished)."""
        return self._owner.get(request_id)

    # ---- commands -------------------------------------------------------------------
    def submit(self, commands: list[Command]) -> None:
        """Route each command (see the module docstring); never blocks on an engine."""
        per: dict[int, list[Command]] = defaultdict(list)
        failed: list[Event] = []
        with self._lock:
            for cmd in commands:
                if cmd[0] == "add":
                    self._route(cmd, per, failed)
                elif cmd[0] == "abort":
                    if (i := self._owner.get(cmd[1])) is not None:
                        per[i].append(cmd)
                elif cmd[0] == "call":
                    live = {r.index for r in self._replicas if r.error is None}
                    if not live:
                        failed.append(self._merged(cmd[1], _Call(cmd[2], live)))
                        continue
                    self._calls[cmd[1]] = _Call(cmd[2], live)
                    for i in live:
                        per[i].append(cmd)
                else:   # "stop"
                    for r in self._replicas:
                        per[r.index].append(cmd)
            for i, cmds in per.items():
                core = self._replicas[i].core
                if core is not None:
                    core.submit(cmds)
            if failed:
                self._on_report(failed, self._total(), None)

    def _route(self, cmd: Command, per: dict[int, list[Command]], failed: list[Event]) -> None:
        rid, prompt, params = cmd[1], cmd[2], cmd[3]
        replicas = self._replicas
        try:
            i = self.router.choose([r.counts.num_running + r.waiting for r in replicas],
                                   [r.error is None for r in replicas], prompt)
        except NoReplicaError as exc:
            failed.append(("failed", rid, ReplicaDeadError(str(exc))))
            return
        replica = replicas[i]
        replica.sent += sequences(params)
        replica.owned.add(rid)
        self._owner[rid] = i
        per[i].append(cmd)

    def stop(self) -> None:
        """Stop every replica (in parallel): each aborts what it holds, reports it and exits."""
        with self._lock:
            self._stopping = True
        cores = [r.core for r in self._replicas if r.core is not None]
        threads = [threading.Thread(target=core.stop, name="polyrunner-dp-stop") for core in cores]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # ---- from the replicas' reader threads ---------------------------------------------
    def _report(self, index: int, events: list[Event], counts: CoreCounts) -> None:
        with self._lock:
            self._replicas[index].counts = counts
            passed: list[Event] = []
            for event in events:
                kind = event[0]
                if kind == "reply":
                    merged = self._reply(index, event)
                    if merged is not None:
                        passed.append(merged)
                    continue
                if kind == "outputs":
                    for out in event[1]:
                        if out.finished:
                            self._release(out.request_id)
                else:   # "rejected" / "aborted"
                    self._release(event[1])
                passed.append(event)
            self._on_report(passed, self._total(), index)

    def _died(self, index: int, exc: BaseException) -> None:
        with self._lock:
            replica = self._replicas[index]
            if replica.error is not None or self._stopping:
                return
            pid = None if replica.core is None else replica.core.process.pid
            replica.error = f"data-parallel replica {index} (pid {pid}) died: {exc}"
            error = ReplicaDeadError(f"{replica.error}; its requests failed, the other replicas keep serving")
            error.__cause__ = exc
            events: list[Event] = [("failed", rid, error) for rid in sorted(replica.owned)]
            for rid in replica.owned:
                self._owner.pop(rid, None)
            replica.owned.clear()
            # nothing runs or waits there any more; everything routed to it is accounted for
            replica.counts = CoreCounts(num_preemptions=replica.counts.num_preemptions, adds_applied=replica.sent,
                                        spec_decode=replica.counts.spec_decode)
            for call_id, call in list(self._calls.items()):
                if index in call.waiting:
                    call.waiting.discard(index)
                    if not call.waiting:
                        events.append(self._merged(call_id, self._calls.pop(call_id)))
            all_dead = all(r.error is not None for r in self._replicas)
            self._on_report(events, self._total(), index)
        if all_dead:
            self._on_dead(EngineDeadError(f"every data-parallel replica died (the last: {replica.error})"))

    def _release(self, request_id: str) -> None:
        i = self._owner.pop(request_id, None)
        if i is not None:
            self._replicas[i].owned.discard(request_id)

    def _reply(self, index: int, event: Event) -> Event | None:
        _, call_id, ok, payload = event
        call = self._calls.get(call_id)
        if call is None:
            return None
        call.results.append((index, ok, payload))
        call.waiting.discard(index)
        return None if call.waiting else self._merged(call_id, self._calls.pop(call_id))

    @staticmethod
    def _merged(call_id: int, call: _Call) -> Event:
        """One reply for a call every replica answered: the first error (naming its replica),
        else add_lora: all loaded; remove_lora: any removed; list_loras: held by every replica."""
        for index, ok, payload in call.results:
            if not ok:
                return ("reply", call_id, False, (payload[0], f"replica {index}: {payload[1]}"))
        results = [payload for _, _, payload in call.results]
        if not results:
            return ("reply", call_id, False, ("ValueError", "no live data-parallel replica answered"))
        if call.method == "add_lora":
            return ("reply", call_id, True, all(results))
        if call.method == "remove_lora":
            return ("reply", call_id, True, any(results))
        if call.method == "list_loras":
            return ("reply", call_id, True, set.intersection(*(set(r) for r in results)))
        return ("reply", call_id, True, results[0])

    def _total(self) -> CoreCounts:
        """The replicas' counts summed (a dead one adds only its cumulative counters)."""
        counts = [r.counts for r in self._replicas]
        sums = {f.name: sum(getattr(c, f.name) for c in counts)
                for f in dataclasses.fields(CoreCounts) if f.name != "spec_decode"}
        specs = [c.spec_decode for c in counts if c.spec_decode is not None]
        spec = tuple(sum(s[k] for s in specs) for k in range(3)) if specs else None
        return CoreCounts(**sums, spec_decode=spec)  # type: ignore[arg-type]
