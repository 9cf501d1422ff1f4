"""One request's outputs on its way from the core's report thread to the asyncio
loop that awaits them: a `RequestStream` per request (a coalescing queue: outputs
are cumulative, so a slow consumer reads only the newest) and `deliver`, which
hands a batch of items to their loops with one thread-safe call per loop."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import TYPE_CHECKING, TypeAlias

from polyrunner.engine.request_stats import RequestTimings
from polyrunner.outputs import RequestOutput
from polyrunner.prompt import Prompt

if TYPE_CHECKING:
    from polyrunner.lora.request import LoRARequest

StreamItem: TypeAlias = RequestOutput | BaseException   # what a RequestStream's queue holds


class RequestStream:
    """One request's outputs, from the engine thread to one asyncio loop."""

    def __init__(self, request_id: str, prompt: Prompt, loop: asyncio.AbstractEventLoop,
                 lora_request: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.loop = loop
        self.lora_request = lora_request   # set on every output (an engine process's deltas leave it out)
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()
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

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (call on its loop): the consumer reads what came
        before, then `error`. The engine request is not aborted: see `AsyncLLM.abort`."""
        if not self.done:
            self.queue.put_nowait(error)


def deliver(items: list[tuple[RequestStream, StreamItem]]) -> None:
    """Hand items to their streams' loops: one thread-safe call per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StreamItem], StreamItem]]] = defaultdict(list)
    for stream, item in items:
        by_loop[stream.loop].append((stream.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:   # that loop is closed: nobody is listening any more
            pass


def _put_all(batch: list[tuple[asyncio.Queue[StreamItem], StreamItem]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
