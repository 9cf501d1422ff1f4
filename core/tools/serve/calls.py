"""One API call's life: its engine requests (one per prompt), admission, the
stream of cumulative outputs, client disconnects, and engine errors as OpenAI
error responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from polyrunner.engine.async_llm import AsyncLLM, EngineDeadError
from polyrunner.engine.request_stream import RequestStream
from polyrunner.outputs import RequestOutput
from polyrunner.sampling_params import SamplingParams
from polyrunner.tools.serve import protocol as P


def json_response(model: BaseModel | dict, status: int = 200, headers: dict | None = None) -> Response:
    body = model.model_dump_json() if isinstance(model, BaseModel) else json.dumps(model)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


@dataclass
class Event:
    index: int                 # which prompt
    output: RequestOutput


class Call:
    """One HTTP request's engine requests: first outputs, merged iteration, abort.

    An exception from an engine stream (a rejection, a dead engine, `expire`) leaves
    `first()` / `events()` as a `RequestError` whose `param` names the request field
    (`param_names` maps engine-side names to the fields the client used)."""

    def __init__(self, llm: AsyncLLM, rid: str, prompts: list[dict[str, Any]], streams: list[RequestStream],
                 request: Request, param_names: dict[str, str] | None = None,
                 open_calls: set[Call] | None = None) -> None:
        self.llm = llm
        self.id = rid
        self.created = int(time.time())
        self.prompts = prompts
        self.streams = streams
        self.latest: list[RequestOutput | None] = [None] * len(streams)
        self.param_names = param_names or {}
        self._expired: P.RequestError | None = None
        self._open_calls = open_calls
        if open_calls is not None:
            open_calls.add(self)
        self._watch = asyncio.create_task(self._abort_on_disconnect(request))

    async def _abort_on_disconnect(self, request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.abort()
                return

    async def first(self) -> None:
        """Wait for each request's first output (the engine accepted it)."""
        results = await asyncio.gather(*(anext(s) for s in self.streams), return_exceptions=True)
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                raise self.error(r)
            self.latest[i] = r
        if self._expired is not None:
            raise self._expired

    async def events(self) -> AsyncIterator[Event]:
        """The first outputs, then every later one as it comes (prompts interleaved)."""
        try:
            async with contextlib.aclosing(self._events()) as events:
                async for event in events:
                    if self._expired is not None:
                        raise self._expired
                    yield event
        except Exception as exc:
            raise self.error(exc) from None

    async def _events(self) -> AsyncIterator[Event]:
        for i, out in enumerate(self.latest):
            yield Event(i, out)
        pending = {i for i, s in enumerate(self.streams) if not s.done}
        if len(pending) == 1:
            (i,) = pending
            async for out in self.streams[i]:
                self.latest[i] = out
                yield Event(i, out)
            return
        tasks = {asyncio.ensure_future(anext(self.streams[i])): i for i in pending}
        try:
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = tasks.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        continue
                    self.latest[i] = out
                    if not self.streams[i].done:
                        tasks[asyncio.ensure_future(anext(self.streams[i]))] = i
                    yield Event(i, out)
        finally:
            for task in tasks:
                task.cancel()

    async def finish_with(self, build) -> Response:
        """Non-streamed: wait for every request to finish, then `build()` the body."""
        try:
            async for _ in self.events():
                pass
        finally:
            self.abort()
            self.close()
        return json_response(build())

    def error(self, exc: BaseException) -> BaseException:
        """What the client hears of `exc` from an engine stream (see the class docstring)."""
        if self._expired is not None:
            return self._expired
        return engine_error(exc, self.param_names)

    def expire(self, error: P.RequestError) -> None:
        """End the call now with `error` (the server's shutdown timeout ran out): its streams
        wake up, it raises `error` from `first()` / `events()`, and its engine requests are aborted."""
        if self._expired is None:
            self._expired = error
            for s in self.streams:
                s.fail(error)
            self.abort()

    def abort(self) -> None:
        for s in self.streams:
            if not s.done:
                self.llm.abort(s.request_id)

    def close(self) -> None:
        self._watch.cancel()
        if self._open_calls is not None:
            self._open_calls.discard(self)


def engine_error(exc: BaseException, param_names: dict[str, str] | None = None) -> BaseException:
    """An engine-side exception as a RequestError: a dead engine is a 503; a rejected request
    (a ValueError, or any error the engine rebuilt, a too-deep schema's RecursionError
    included) a 400 naming the field. Anything else is returned as it is (a server bug)."""
    if isinstance(exc, P.RequestError):
        return exc
    if isinstance(exc, EngineDeadError):
        return P.RequestError(str(exc), None, 503, type="server_error")
    if isinstance(exc, (ValueError, TypeError, KeyError, RecursionError)):
        message = str(exc) if not isinstance(exc, RecursionError) else f"the request is nested too deeply: {exc}"
        param = param_of(message)
        return P.RequestError(message, (param_names or {}).get(param, param))
    return exc


def param_of(message: str) -> str | None:
    """Which request field an engine message is about (best effort): the first
    SamplingParams field named in its first clause, else the prompt if named."""
    words = re.findall(r"[a-z_]+", message.removeprefix("invalid SamplingParams: ").split(";", 1)[0][:500])
    for word in words:
        if word in SamplingParams.model_fields:
            return word
    return "prompt" if any(w.startswith("prompt") for w in words) else None
