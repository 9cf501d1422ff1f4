"""One API call's life: its engine requests (one per prompt), admission, the
stream of cumulative outputs, client disconnects, and engine errors as OpenAI
error responses."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from polyrunner.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from polyrunner.outputs import RequestOutput
from polyrunner.sampling_params import SamplingParams
from polyrunner.tools.serve import protocol as P
from pydantic import BaseModel


def json_response(model: BaseModel | dict, status: int = 200, headers: dict | None = None) -> Response:
    body = model.model_dump_json() if isinstance(model, BaseModel) else json.dumps(model)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


@dataclass
class Event:
    index: int                 # which prompt
    output: RequestOutput


class Call:
    """One HTTP request's engine requests: first outputs, merged iteration, abort."""

    def __init__(self, llm: AsyncLLM, rid: str, prompts: list[dict[str, Any]], streams: list[RequestStream],
                 request: Request) -> None:
        self.llm = llm
        self.id = rid
        self.created = int(time.time())
        self.prompts = prompts
        self.streams = streams
        self.latest: list[RequestOutput | None] = [None] * len(streams)
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
                raise engine_error(r)
            self.latest[i] = r

    async def events(self) -> AsyncIterator[Event]:
        """The first outputs, then every later one as it comes (prompts interleaved)."""
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
        except Exception as exc:
            raise engine_error(exc) from None
        finally:
            self.abort()
            self.close()
        return json_response(build())

    def abort(self) -> None:
        for s in self.streams:
            if not s.done:
                self.llm.abort(s.request_id)

    def close(self) -> None:
        self._watch.cancel()


def engine_error(exc: BaseException) -> BaseException:
    if isinstance(exc, P.RequestError):
        return exc
    if isinstance(exc, EngineDeadError):
        return P.RequestError(str(exc), None, 503, type="server_error")
    if isinstance(exc, ValueError):
        return P.RequestError(str(exc), param_of(str(exc)))
    return exc


def param_of(message: str) -> str | None:
    """Which request field an engine message is about (best effort): the first
    SamplingParams field named in its first clause, else the prompt if named."""
    words = re.findall(r"[a-z_]+", message.removeprefix("invalid SamplingParams: ").split(";", 1)[0])
    for word in words:
        if word in SamplingParams.model_fields:
            return word
    return "prompt" if any(w.startswith("prompt") for w in words) else None
