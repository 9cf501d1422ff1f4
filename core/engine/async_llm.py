"""AsyncLLM: requests that arrive and leave at any time, served by one engine
that steps continuously (vLLM's name and shape).

The engine runs in an engine core: `EngineProcess` (its own process — the
default for `polyrunner serve`; the server and the engine never share a GIL)
or `EngineThread` (a background thread of this process; `.engine` can be
inspected). Both run the same `EngineLoop` and report, after every loop turn,
what happened (outputs, rejections, aborts) and the engine's counts; this
frontend turns that into per-request streams:

    caller (any asyncio loop)                core's report thread
    generate() -> add_request():             on_report(events, counts):
      register a RequestStream and submit      record timings, build StepStats,
      ("add", ...) to the core                 hand each output to its stream's
    abort(): submit ("abort", id)              loop (one call_soon_threadsafe per
    RequestStream.__anext__ awaits its         loop per report)
      own asyncio.Queue

Outputs are cumulative (text, token ids and logprobs so far), so a consumer
that falls behind reads only the newest one (the queue is coalesced). A request
the engine refuses gets that error from its iterator and nothing else changes;
if the engine dies, every pending request fails with `EngineDeadError`,
`is_healthy` turns False and later calls fail at once.

Per-request timings (arrival, first token, each token, finish) are recorded as
outputs arrive; stats listeners (the server's metrics) get one `StepStats` per
report.

Data parallelism (`data_parallel_size=N > 1`): the core is `DPCores`, N engine
processes behind this one frontend (`dp_cores`: routing, aborts to the owning
replica, engine calls to every replica); a replica's death fails its requests
alone (a "failed" event each) and `degraded` turns True; `replica_states()` says
what each replica holds. Stats carry the replica whose report they come from.

Adapters (vLLM's `add_lora` / `remove_lora` / `list_loras`) are engine calls:
each submits ("call", id, method, args) and awaits a future that the report
thread resolves from the loop's ("reply", id, ok, result) event; an engine-side
error comes back as the caller's exception (ValueError for a refused adapter).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pickle
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from polyrunner import envs
from polyrunner.engine.core_errors import EngineDeadError as EngineDeadError  # re-exported: its old home
from polyrunner.engine.dp_cores import DPCores, ReplicaState
from polyrunner.engine.engine_builder import engine_of
from polyrunner.engine.engine_loop import Command, CoreCounts, Event, rebuild_error, sequences
from polyrunner.engine.engine_process import EngineProcess
from polyrunner.engine.engine_thread import EngineThread
from polyrunner.engine.request_stats import RequestTimings as RequestTimings  # re-exported: its old home
from polyrunner.engine.request_stats import StatsListener, StepStats
from polyrunner.engine.request_stream import RequestStream, StreamItem, deliver
from polyrunner.outputs import CompletionOutput, RequestOutput
from polyrunner.prompt import Prompt
from polyrunner.sampling_params import SamplingParams

if TYPE_CHECKING:   # not at run time: the frontend of an engine process stays light
    from polyrunner.config import LoRAConfig
    from polyrunner.engine.llm_engine import LLMEngine
    from polyrunner.engine.tokenizer import Tokenizer
    from polyrunner.lora.request import LoRARequest
    from polyrunner.models.arch import DecoderArch

logger = logging.getLogger(__name__)


class EngineNotAcceptingError(RuntimeError):
    """The engine is shutting down (or shut down) and takes no new requests."""


class AsyncLLM:
    """An engine serving concurrent async callers.

    `AsyncLLM(model=None, backend=None, engine_process=False, **kwargs)` takes
    `LLM`'s arguments; `engine_process=True` runs the engine in its own process
    (None: the `POLYRUNNER_ENGINE_PROCESS` environment variable, 1 or 0, default 0).
    `data_parallel_size=N > 1` runs N engine processes (whatever `engine_process` says),
    requests going to one by `routing` ("least_loaded" or "cache_aware": `dp_router`).
    `AsyncLLM.from_engine(engine)` wraps an existing `LLMEngine` in a thread (and
    then owns it).
    """

    _core: EngineProcess | EngineThread | DPCores

    def __init__(self, model: str | None = None, backend: str | None = None, *,
                 engine_process: bool | None = None, routing: str = "least_loaded", **llm_kwargs: Any) -> None:
        if engine_process is None:
            engine_process = envs.ENGINE_PROCESS.get()
        self._setup()
        replicas = int(llm_kwargs.get("data_parallel_size") or 1)
        if replicas > 1:
            self._core = DPCores({"model": model, "backend": backend, **llm_kwargs}, replicas, self._on_report,
                                 self._die, engine_of, routing)
        elif engine_process:
            self._core = EngineProcess({"model": model, "backend": backend, **llm_kwargs},
                                       self._on_report, self._die, engine_of)
        else:
            self._core = EngineThread(engine_of({"model": model, "backend": backend, **llm_kwargs}), self._on_report,
                                      self._die)
        self._counts = self._core.initial_counts

    @classmethod
    def from_engine_args(cls, **llm_kwargs: Any) -> AsyncLLM:
        return cls(**llm_kwargs)

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> AsyncLLM:
        self = cls.__new__(cls)
        self._setup()
        self._core = EngineThread(engine, self._on_report, self._die)
        self._counts = self._core.initial_counts
        return self

    def _setup(self) -> None:
        self._cv = threading.Condition(threading.RLock())
        self._streams: dict[str, RequestStream] = {}
        self._outbox: list[Command] = []      # commands held back by `batch()`
        self._batch_depth = 0
        self._adds_sent = 0                   # sequences submitted (n per request), cumulative
        self._accepting = True
        self._stopped = False
        self._dead: EngineDeadError | None = None
        self._listeners: list[StatsListener] = []
        self._replies: dict[int, asyncio.Future[Any]] = {}   # engine calls awaiting their reply
        self._last_call_id = 0

    # ---- what callers read ---------------------------------------------------------
    @property
    def engine(self) -> LLMEngine:
        """The `LLMEngine` (engine in a thread only: a process's engine is not reachable)."""
        engine: LLMEngine | None = getattr(self._core, "engine", None)
        if engine is None:
            raise AttributeError("the engine runs in its own process (engine_process=True); "
                                 "read AsyncLLM's counts instead")
        return engine

    @property
    def engine_process(self) -> bool:
        return isinstance(self._core, (EngineProcess, DPCores))

    @property
    def data_parallel_size(self) -> int:
        return self._core.size if isinstance(self._core, DPCores) else 1

    def replica_states(self) -> list[ReplicaState]:
        """Each replica's state (one entry for a single core)."""
        if isinstance(self._core, DPCores):
            return self._core.states()
        pid = self._core.process.pid if isinstance(self._core, EngineProcess) else None
        return [ReplicaState(0, self.is_healthy, self._counts, self.num_waiting, pid,
                             None if self._dead is None else str(self._dead))]

    @property
    def degraded(self) -> bool:
        """Some data-parallel replica died while others still serve."""
        return self.is_healthy and any(not r.alive for r in self.replica_states())

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._core.info.tokenizer

    def get_tokenizer(self) -> Tokenizer | None:
        return self._core.info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._core.info.vocab_size

    @property
    def arch(self) -> DecoderArch | None:
        """The model's architecture (to check an adapter against it)."""
        return self._core.info.arch

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The engine's LoRA limits; None when LoRA is off (`enable_lora=False`)."""
        return self._core.info.lora

    @property
    def counts(self) -> CoreCounts:
        """The engine's counts after its latest loop turn."""
        return self._counts

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._core.alive

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine is dead."""
        if self._dead is not None:
            raise self._dead
        if not self._core.alive and not self._stopped:
            raise EngineDeadError("the engine is not running")

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet finished (each `n > 1` request counts once)."""
        return len(self._streams)

    @property
    def num_running(self) -> int:
        return self._counts.num_running

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a slot: the scheduler's queue plus adds not yet applied."""
        counts = self._counts
        return counts.num_waiting + max(0, self._adds_sent - counts.adds_applied)

    @property
    def kv_cache_usage(self) -> float:
        return self._counts.kv_cache_usage

    def add_stats_listener(self, listener: StatsListener) -> None:
        """`listener(StepStats)` runs in the core's report thread after every loop turn; keep it cheap."""
        with self._cv:
            self._listeners = [*self._listeners, listener]

    def remove_stats_listener(self, listener: StatsListener) -> None:
        with self._cv:
            self._listeners = [x for x in self._listeners if x is not listener]

    # ---- requests -------------------------------------------------------------------
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request (run with `lora_request`'s adapter when given); returns its stream
        (an async iterator of RequestOutput). Call from inside a running asyncio loop: the
        outputs arrive on that loop."""
        loop = asyncio.get_running_loop()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        if self.engine_process and params.logits_processors:
            _check_picklable(params.logits_processors)
        with self._cv:
            if self._dead is not None:
                raise self._dead
            if not self._accepting:
                raise EngineNotAcceptingError("the engine is shutting down and takes no new requests")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            stream = RequestStream(request_id, prompt, loop, lora_request)
            self._streams[request_id] = stream
            self._adds_sent += sequences(params)
        self._submit(("add", request_id, prompt, params, priority, lora_request))
        return stream

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Requests added inside this block reach the engine together (same step)."""
        with self._cv:
            self._batch_depth += 1
        try:
            yield
        finally:
            with self._cv:
                self._batch_depth -= 1
                commands = []
                if self._batch_depth == 0:
                    commands, self._outbox = self._outbox, []
            if commands:
                self._core.submit(commands)

    def _submit(self, command: Command) -> None:
        """Hand one command to the core (held back inside `batch()`). Never under `_cv`:
        the core's report thread needs it."""
        with self._cv:
            if self._batch_depth:
                self._outbox.append(command)
                return
        self._core.submit([command])

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative) as tokens arrive; the last one has
        `finished=True`. Raises ValueError for an invalid request, EngineDeadError if
        the engine dies. Leaving the iteration early (or being cancelled) aborts it."""
        stream = self.add_request(prompt, sampling_params, request_id, priority, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.done:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed on the engine loop's next turn and its
        stream ends with a `finish_reason="abort"` output. Unknown ids are ignored."""
        if request_id in self._streams:
            self._submit(("abort", request_id))

    # ---- adapters (engine calls) --------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into the engine (vLLM's); ValueError when LoRA is off or the
        adapter is refused."""
        return bool(await self._call("add_lora", lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the engine; False when it held none with that id."""
        return bool(await self._call("remove_lora", lora_int_id))

    async def list_loras(self) -> set[int]:
        """The ids of the adapters the engine holds."""
        return set(await self._call("list_loras"))

    async def _call(self, method: str, *args: Any) -> Any:
        """Run `engine.method(*args)` on the engine loop (between steps) and return its
        result; its exception is raised here (rebuilt: ValueError, TypeError or KeyError)."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with self._cv:
            if self._dead is not None:
                raise self._dead
            if not self._accepting:
                raise EngineNotAcceptingError("the engine is shutting down and takes no new calls")
            self._last_call_id += 1
            call_id = self._last_call_id
            self._replies[call_id] = future
        self._core.submit([("call", call_id, method, args)])   # never held back by `batch()`: awaited now
        try:
            return await future
        finally:
            with self._cv:
                self._replies.pop(call_id, None)

    def _fail_calls(self, error: BaseException) -> None:
        """Every engine call still waiting for its reply raises `error`."""
        with self._cv:
            futures, self._replies = list(self._replies.values()), {}
        for future in futures:
            _resolve_soon(future, error)

    # ---- shutdown -------------------------------------------------------------------
    def shutdown(self, timeout: float | None = 0.0) -> None:
        """Stop taking requests, let running ones finish for up to `timeout` seconds
        (None: no limit), abort the rest and stop the engine core."""
        with self._cv:
            self._accepting = False
            self._cv.wait_for(lambda: not self._streams or self._dead is not None, timeout)
            if self._stopped:
                return
            self._stopped = True
        self._core.stop()
        with self._cv:   # a core that died before it could report its aborts
            streams, self._streams = list(self._streams.values()), {}
            self._cv.notify_all()
        deliver([(s, self._aborted_output(s)) for s in streams])
        self._fail_calls(EngineNotAcceptingError("the engine shut down before it answered"))

    async def shutdown_async(self, timeout: float | None = 0.0) -> None:
        """`shutdown` without blocking the caller's loop (its streams keep flowing)."""
        await asyncio.to_thread(self.shutdown, timeout)

    # ---- reports from the core (its thread) ---------------------------------------------
    def _on_report(self, events: list[Event], counts: CoreCounts, replica: int | None = None) -> None:
        now = time.monotonic()
        preempted = counts.num_preemptions - self._counts.num_preemptions
        self._counts = counts
        stats = StepStats(counts.num_running, self.num_waiting, preempted, replica=replica)
        deliveries: list[tuple[RequestStream, StreamItem]] = []
        ended: list[RequestStream] = []
        for event in events:
            kind = event[0]
            if kind == "reply":
                self._reply(event)
                continue
            if kind == "outputs":
                for out in event[1]:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    self._record(stream, out, now, stats)
                    if out.lora_request is None:
                        out.lora_request = stream.lora_request
                    stream.last = out
                    deliveries.append((stream, out))
                    if out.finished:
                        ended.append(stream)
                continue
            stream = self._streams.get(event[1])
            if stream is None:
                continue
            t = stream.timings
            t.finished_time = now
            if kind in ("rejected", "failed"):   # failed: its data-parallel replica died
                t.finish_reason = "error"
                deliveries.append((stream, rebuild_error(*event[2]) if kind == "rejected" else event[2]))
            else:
                t.finish_reason = "abort"
                stats.finished.append(t)
                deliveries.append((stream, self._aborted_output(stream)))
            ended.append(stream)
        if ended:
            with self._cv:
                for stream in ended:
                    self._streams.pop(stream.request_id, None)
                self._cv.notify_all()
        self._notify(stats)   # before delivery: a caller that got its output sees it counted
        deliver(deliveries)

    def _reply(self, event: Event) -> None:
        _, call_id, ok, payload = event
        with self._cv:
            future = self._replies.pop(call_id, None)
        if future is not None:
            _resolve_soon(future, payload if ok else rebuild_error(*payload))

    def _notify(self, stats: StepStats) -> None:
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("stats listener failed")

    @staticmethod
    def _record(stream: RequestStream, out: RequestOutput, now: float, stats: StepStats) -> None:
        t = stream.timings
        count = sum(len(c.token_ids) for c in out.outputs)
        new = count - t.num_generation_tokens
        if new > 0:
            if t.first_token_time is None:
                t.first_token_time = now
                t.num_prompt_tokens = len(out.prompt_token_ids)
                stats.num_prompt_tokens += t.num_prompt_tokens
                stats.time_to_first_token.append(now - t.arrival_time)
            else:
                stats.inter_token_latency.append(now - t.token_times[-1])
            t.token_times.append(now)
            t.num_generation_tokens = count
            stats.num_generation_tokens += new
        if out.finished:
            t.finished_time = now
            reasons = [c.finish_reason for c in out.outputs]
            t.finish_reason = "stop" if "stop" in reasons else reasons[0] if reasons else None
            stats.finished.append(t)

    @staticmethod
    def _aborted_output(stream: RequestStream) -> RequestOutput:
        last = stream.last
        if last is None:
            prompt = stream.prompt
            text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
            ids = list(prompt.get("prompt_token_ids") or []) if isinstance(prompt, dict) else []
            return RequestOutput(stream.request_id, text, ids,
                                 outputs=[CompletionOutput(0, "", [], finish_reason="abort")], finished=True,
                                 lora_request=stream.lora_request)
        outs = [c if c.finished() else dataclasses.replace(c, finish_reason="abort") for c in last.outputs]
        return dataclasses.replace(last, outputs=outs, finished=True)

    def _die(self, exc: BaseException) -> None:
        logger.error("the engine died", exc_info=exc)
        error = EngineDeadError(f"the engine loop died ({type(exc).__name__}: {exc}); "
                                "pending requests failed and no new request can be served")
        error.__cause__ = exc
        with self._cv:
            self._dead = error
            self._accepting = False
            streams = list(self._streams.values())
            self._streams.clear()
            self._outbox.clear()
            self._cv.notify_all()
        deliver([(s, error) for s in streams])
        self._fail_calls(error)


def _check_picklable(processors: Any) -> None:
    try:
        pickle.dumps(processors)
    except Exception as exc:   # noqa: BLE001 - lambdas, closures, local classes
        raise ValueError("logits_processors must be picklable (module-level functions or classes) when the "
                         f"engine runs in its own process: {exc}") from None


def _resolve_soon(future: asyncio.Future[Any], result: Any) -> None:
    """Settle `future` on its loop with `result` (raised when it is an exception)."""
    def settle() -> None:
        if future.done():   # the caller was cancelled
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    try:
        future.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:   # that loop is closed: nobody is waiting any more
        pass
