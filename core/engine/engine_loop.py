"""The busy loop around one `LLMEngine`, shared by the in-thread and the
in-process engine cores.

    loop:
        take the queued commands (wait for one when there is no work)
        apply them between steps: ("add", request_id, prompt, params, priority, lora_request),
                                  ("abort", request_id), ("call", call_id, method, args),
                                  ("stop",)
        step the engine if any request is unfinished
        report(events, counts)     # events in order; counts after them

Events are ("rejected", request_id, (error type, message)) for an add the
engine refused (the request fails alone) — at once, or, for a structured-output
request whose grammar compiles off the step (`wait_for_grammar=False`: adds
never wait for a compile), from the step that found the grammar invalid or too
slow (before any output of it) — ("aborted", request_id) once an abort freed
the request's blocks, and ("outputs", [RequestOutput]) for a step. A
"stop" aborts every request, reports them and ends the loop. An exception from
`engine.step()` ends the loop too: the caller reports the engine dead.

A "call" runs one of the engine's adapter methods (`CALLS`: add_lora,
remove_lora, list_loras) between steps and answers with ("reply", call_id, True,
result), or ("reply", call_id, False, (error type, message)) when it raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from polyrunner.outputs import RequestOutput

if TYPE_CHECKING:
    from polyrunner.config import LoRAConfig
    from polyrunner.engine.llm_engine import LLMEngine
    from polyrunner.engine.tokenizer import Tokenizer
    from polyrunner.models.arch import DecoderArch

Command: TypeAlias = tuple[Any, ...]
Event: TypeAlias = tuple[Any, ...]

CALLS = frozenset({"add_lora", "remove_lora", "list_loras"})   # the engine methods a "call" may run


@dataclass(frozen=True)
class CoreInfo:
    """What a frontend needs to know of the engine it talks to."""

    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    arch: DecoderArch | None = None   # for checking an adapter against the model (frontend side)
    lora: LoRAConfig | None = None    # None: LoRA is off

    @classmethod
    def of(cls, engine: LLMEngine) -> CoreInfo:
        return cls(engine.tokenizer, engine.max_model_len, engine.arch.vocab_size, engine.arch, engine.config.lora)


@dataclass(frozen=True)
class CoreCounts:
    """The engine's state after a loop turn (for gauges, the waiting cap and tests)."""

    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0          # cumulative
    kv_free_blocks: int = 0
    kv_usable_blocks: int = 0
    adds_applied: int = 0             # sequences (n per request) taken from the queue, cumulative
    num_unfinished: int = 0           # requests the engine still holds
    runner_active: int = 0            # slots the model runner still holds
    spec_decode: tuple[int, int, int] | None = None   # cumulative (drafts, draft tokens, accepted); None: off

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.kv_free_blocks / max(self.kv_usable_blocks, 1)

    @property
    def idle(self) -> bool:
        """Nothing held: no request, every KV block free, no runner state."""
        return (self.num_unfinished == 0 and self.kv_free_blocks == self.kv_usable_blocks
                and self.runner_active == 0)


def _spec_counts(engine: LLMEngine) -> tuple[int, int, int] | None:
    stats = getattr(engine, "speculative_stats", lambda: None)()
    return None if stats is None else (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)


def sequences(params: Any) -> int:
    """How many sequences a request becomes (its `n`)."""
    return max(1, getattr(params, "n", 1) or 1)


class Inbox(Protocol):
    def take(self, block: bool) -> list[Command]:
        """The queued commands; with `block`, wait until there is at least one."""


class ThreadInbox:
    """Commands from any thread to the engine thread."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: list[Command] = []

    def put(self, commands: list[Command]) -> None:
        with self._cv:
            self._items.extend(commands)
            self._cv.notify()

    def take(self, block: bool) -> list[Command]:
        with self._cv:
            while block and not self._items:
                self._cv.wait()
            items, self._items = self._items, []
        return items


class EngineLoop:
    """Steps one engine while there is work; see the module docstring."""

    def __init__(self, engine: LLMEngine, inbox: Inbox, report: Callable[[list[Event], CoreCounts], None]) -> None:
        self.engine = engine
        self.inbox = inbox
        self.report = report
        self.active: set[str] = set()
        self.adds_applied = 0

    def run(self) -> None:
        engine = self.engine
        while True:
            events: list[Event] = []
            for cmd in self.inbox.take(block=not engine.has_requests()):
                if cmd[0] == "stop":
                    for rid in list(self.active):
                        self._abort(rid, events)
                    while engine.has_requests():   # the step in flight, then the hand-over of the slots
                        engine.step()
                    self.report(events, self.counts())
                    return
                self._apply(cmd, events)
            if engine.has_requests():
                outs = engine.step()
                if engine.rejected:
                    outs = self._rejections(outs, events)
                for out in outs:
                    if out.finished:
                        self.active.discard(out.request_id)
                events.append(("outputs", outs))
            self.report(events, self.counts())

    def _rejections(self, outs: list[RequestOutput], events: list[Event]) -> list[RequestOutput]:
        """Report the step's rejected requests (grammar failures) as "rejected", not as outputs."""
        rejected = {rid: error for rid, error in self.engine.rejected}
        for rid, error in rejected.items():
            self.active.discard(rid)
            events.append(("rejected", rid, (type(error).__name__, str(error))))
        return [out for out in outs if out.request_id not in rejected]

    def _apply(self, cmd: Command, events: list[Event]) -> None:
        if cmd[0] == "abort":
            self._abort(cmd[1], events)
            return
        if cmd[0] == "call":
            self._call(cmd[1], cmd[2], cmd[3], events)
            return
        _, rid, prompt, params, priority, lora_request = cmd
        self.adds_applied += sequences(params)
        try:
            self.engine.add_request(prompt, params, request_id=rid, stream=True, priority=priority,
                                    wait_for_grammar=False, lora_request=lora_request)
        except Exception as exc:   # noqa: BLE001 - a bad request fails alone
            self.engine.abort_request(rid)   # drop any half-made state
            events.append(("rejected", rid, (type(exc).__name__, str(exc))))
            return
        self.active.add(rid)

    def _call(self, call_id: int, method: str, args: tuple[Any, ...], events: list[Event]) -> None:
        try:
            if method not in CALLS:
                raise ValueError(f"unknown engine call {method!r} (allowed: {sorted(CALLS)})")
            result = getattr(self.engine, method)(*args)
        except Exception as exc:   # noqa: BLE001 - the caller hears of it; the engine carries on
            events.append(("reply", call_id, False, (type(exc).__name__, str(exc))))
            return
        events.append(("reply", call_id, True, result))

    def _abort(self, rid: str, events: list[Event]) -> None:
        self.engine.abort_request(rid)
        if rid in self.active:
            self.active.discard(rid)
            events.append(("aborted", rid))

    def counts(self) -> CoreCounts:
        eng = self.engine
        sched, pool = eng.scheduler, eng.kv.pool
        return CoreCounts(len(sched.running), sched.num_waiting, sched.num_preemptions, pool.num_free_blocks,
                          pool.num_usable_blocks, self.adds_applied, sched.num_unfinished,
                          eng.runner.states.num_active, _spec_counts(eng))


def rebuild_error(kind: str, message: str) -> Exception:
    """The frontend's copy of an engine-side rejection (its type where it is a standard one)."""
    cls = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError}.get(kind, ValueError)
    return cls(message)
