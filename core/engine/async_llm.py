"""AsyncLLM: an `LLMEngine` stepped continuously in one background thread, with
requests that arrive and leave at any time (vLLM's name and shape).

Threading model. The engine is not thread-safe, so exactly one thread — the
engine thread — ever touches it. Callers talk to it through a command list
guarded by one condition variable:

    caller (any asyncio loop)                engine thread
    generate() -> add_request():             loop:
      register a RequestStream, append         wait on the condition while idle
      ("add", ...) and notify                  take every queued command
    abort(): append ("abort"), notify          apply adds / aborts (between steps)
                                               engine.step() if anything is unfinished
    RequestStream.__anext__ awaits its         hand each output to its stream's loop:
      own asyncio.Queue                        one loop.call_soon_threadsafe per loop
                                               per step, which fills the queues

Outputs are cumulative (text, token ids and logprobs so far), so a consumer
that falls behind reads only the newest one (the queue is coalesced). A request
whose `add_request` raises gets that error from its iterator and nothing else
changes; if the loop itself raises, every pending request fails with
`EngineDeadError`, `is_healthy` turns False and later calls fail at once. The
loop sleeps on the condition when there is nothing to do.

Per-request timings (arrival, first token, each token, finish) are recorded in
the engine thread as outputs are delivered; stats listeners (the server's
metrics) get one `StepStats` per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from polyrunner.outputs import CompletionOutput, RequestOutput
from polyrunner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | dict[str, Any]


class EngineDeadError(RuntimeError):
    """The engine loop died; no request can be served until it is restarted."""


class EngineNotAcceptingError(RuntimeError):
    """The engine is shutting down (or shut down) and takes no new requests."""


@dataclass
class RequestTimings:
    """When things happened to one request (time.monotonic seconds)."""

    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # one entry per step that produced tokens
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    finish_reason: str | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class StepStats:
    """What one engine step did, for metrics (built in the engine thread)."""

    num_running: int
    num_waiting: int
    num_preemptions: int                      # preemptions in this step
    num_prompt_tokens: int = 0                # prompts of requests that got their first token
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[RequestTimings] = field(default_factory=list)


StatsListener = Callable[[StepStats], None]

class RequestStream:
    """One request's outputs, from the engine thread to one asyncio loop."""

    def __init__(self, request_id: str, prompt: Prompt, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.timings = RequestTimings(time.monotonic())
        self.last: RequestOutput | None = None     # engine thread only
        self.done = False                           # consumer side: the final item was read

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        items = [await self.queue.get()]
        while not self.queue.empty():   # outputs are cumulative: only the newest matters
            items.append(self.queue.get_nowait())
        outs = [i for i in items if isinstance(i, RequestOutput)]
        error = next((i for i in items if isinstance(i, BaseException)), None)
        if outs:
            out = outs[-1]
            if out.finished:
                self.done = True
            elif error is not None:   # deliver what came before the error, then the error
                self.queue.put_nowait(error)
            return out
        self.done = True
        if error is not None:
            raise error
        raise StopAsyncIteration


class AsyncLLM:
    """An engine serving concurrent async callers.

    `AsyncLLM(model=None, backend=None, **kwargs)` takes `LLM`'s arguments;
    `AsyncLLM.from_engine(engine)` wraps an existing `LLMEngine` (which it then owns).
    """

    def __init__(self, model: str | None = None, backend: str | None = None, **llm_kwargs: Any) -> None:
        from polyrunner.llm import LLM
        self._setup(LLM(model, backend, **llm_kwargs).engine)

    @classmethod
    def from_engine_args(cls, **llm_kwargs: Any) -> AsyncLLM:
        return cls(**llm_kwargs)

    @classmethod
    def from_engine(cls, engine) -> AsyncLLM:
        self = cls.__new__(cls)
        self._setup(engine)
        return self

    def _setup(self, engine) -> None:
        self.engine = engine
        self._cv = threading.Condition(threading.RLock())
        self._commands: list[tuple] = []
        self._streams: dict[str, RequestStream] = {}
        self._num_pending_adds = 0
        self._accepting = True
        self._stop = False
        self._dead: EngineDeadError | None = None
        self._listeners: list[StatsListener] = []
        self._preemptions_seen = engine.scheduler.num_preemptions
        self._thread = threading.Thread(target=self._run, name="polyrunner-engine", daemon=True)
        self._thread.start()

    # ---- what callers read ---------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def check_health(self) -> None:
        """Raise EngineDeadError when the loop is dead."""
        if self._dead is not None:
            raise self._dead
        if not self._thread.is_alive() and not self._stop:
            raise EngineDeadError("the engine thread is not running")

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet finished (each `n > 1` request counts once)."""
        return len(self._streams)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a slot: the scheduler's queue plus adds not yet applied."""
        return len(self.engine.scheduler.waiting) + self._num_pending_adds

    def add_stats_listener(self, listener: StatsListener) -> None:
        """`listener(StepStats)` runs in the engine thread after every step; keep it cheap."""
        with self._cv:
            self._listeners = [*self._listeners, listener]

    def remove_stats_listener(self, listener: StatsListener) -> None:
        with self._cv:
            self._listeners = [x for x in self._listeners if x is not listener]

    # ---- requests -------------------------------------------------------------------
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> RequestStream:
        """Queue a request; returns its stream (an async iterator of RequestOutput).
        Call from inside a running asyncio loop: the outputs arrive on that loop."""
        loop = asyncio.get_running_loop()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        with self._cv:
            if self._dead is not None:
                raise self._dead
            if not self._accepting:
                raise EngineNotAcceptingError("the engine is shutting down and takes no new requests")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            stream = RequestStream(request_id, prompt, loop)
            self._streams[request_id] = stream
            self._num_pending_adds += max(1, getattr(params, "n", 1))
            self._commands.append(("add", stream, prompt, params))
            self._cv.notify()
        return stream

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Requests added inside this block reach the engine together (same step)."""
        with self._cv:
            yield

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (cumulative) as tokens arrive; the last one has
        `finished=True`. Raises ValueError for an invalid request, EngineDeadError if
        the loop dies. Leaving the iteration early (or being cancelled) aborts it."""
        stream = self.add_request(prompt, sampling_params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.done:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed on the engine loop's next turn and its
        stream ends with a `finish_reason="abort"` output. Unknown ids are ignored."""
        with self._cv:
            if request_id in self._streams:
                self._commands.append(("abort", request_id))
                self._cv.notify()

    # ---- shutdown -------------------------------------------------------------------
    def shutdown(self, timeout: float | None = 0.0) -> None:
        """Stop taking requests, let running ones finish for up to `timeout` seconds
        (None: no limit), abort the rest and stop the engine thread."""
        with self._cv:
            self._accepting = False
            self._cv.wait_for(lambda: not self._streams or self._dead is not None, timeout)
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    async def shutdown_async(self, timeout: float | None = 0.0) -> None:
        """`shutdown` without blocking the caller's loop (its streams keep flowing)."""
        await asyncio.to_thread(self.shutdown, timeout)

    # ---- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._commands or self._stop or self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    commands, self._commands = self._commands, []
                    stop = self._stop
                for cmd in commands:
                    self._apply(cmd)
                if stop:
                    for rid in list(self._streams):
                        self._apply(("abort", rid))
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as exc:   # noqa: BLE001 - every pending request must hear of it
            self._die(exc)

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, stream, prompt, params = cmd
            with self._cv:
                self._num_pending_adds -= max(1, getattr(params, "n", 1))
            try:
                self.engine.add_request(prompt, params, request_id=stream.request_id, stream=True)
            except Exception as exc:   # noqa: BLE001 - a bad request fails alone
                self.engine.abort_request(stream.request_id)   # drop any half-made state
                self._finish(stream, exc)
            return
        rid = cmd[1]
        stream = self._streams.get(rid)
        self.engine.abort_request(rid)
        if stream is not None:
            self._finish(stream, self._aborted_output(stream))

    def _step(self) -> None:
        outs = self.engine.step()
        now = time.monotonic()
        sched = self.engine.scheduler
        preempted = sched.num_preemptions - self._preemptions_seen
        self._preemptions_seen = sched.num_preemptions
        stats = StepStats(len(sched.running), len(sched.waiting) + self._num_pending_adds, preempted)
        deliveries: list[tuple[RequestStream, Any]] = []
        finished: list[RequestStream] = []
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._record(stream, out, now, stats)
            stream.last = out
            deliveries.append((stream, out))
            if out.finished:
                finished.append(stream)
        if finished:
            with self._cv:
                for stream in finished:
                    self._streams.pop(stream.request_id, None)
                self._cv.notify_all()
        self._notify(stats)   # before delivery: a caller that got its output sees it counted
        _deliver(deliveries)

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

    def _finish(self, stream: RequestStream, item: Any) -> None:
        """End a stream outside a step: a rejected request (an exception) or an abort."""
        t = stream.timings
        t.finished_time = time.monotonic()
        t.finish_reason = "error" if isinstance(item, BaseException) else "abort"
        with self._cv:
            self._streams.pop(stream.request_id, None)
            self._cv.notify_all()
        if t.finish_reason == "abort":
            sched = self.engine.scheduler
            self._notify(StepStats(len(sched.running), len(sched.waiting) + self._num_pending_adds, 0,
                                   finished=[t]))
        _deliver([(stream, item)])

    @staticmethod
    def _aborted_output(stream: RequestStream) -> RequestOutput:
        last = stream.last
        if last is None:
            prompt = stream.prompt
            text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
            ids = list(prompt.get("prompt_token_ids") or []) if isinstance(prompt, dict) else []
            return RequestOutput(stream.request_id, text, ids, [CompletionOutput(0, "", [], "abort")], finished=True)
        outs = [c if c.finished else dataclasses.replace(c, finish_reason="abort") for c in last.outputs]
        return dataclasses.replace(last, outputs=outs, finished=True)

    def _die(self, exc: BaseException) -> None:
        logger.error("the engine loop died", exc_info=exc)
        error = EngineDeadError(f"the engine loop died ({type(exc).__name__}: {exc}); "
                                "pending requests failed and no new request can be served")
        error.__cause__ = exc
        with self._cv:
            self._dead = error
            self._accepting = False
            streams = list(self._streams.values())
            self._streams.clear()
            self._commands.clear()
            self._num_pending_adds = 0
            self._cv.notify_all()
        _deliver([(s, error) for s in streams])


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    """Hand items to their streams' loops: one thread-safe call per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = defaultdict(list)
    for stream, item in items:
        by_loop[stream.loop].append((stream.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:   # that loop is closed: nobody is listening any more
            pass


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
