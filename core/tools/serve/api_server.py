"""The OpenAI-compatible HTTP API over an `AsyncLLM` (FastAPI).

`build_app(async_llm, ...)` returns the app; `polyrunner serve` runs it with
uvicorn (launcher.py). Endpoints: POST /v1/completions, POST
/v1/chat/completions, GET /v1/models, GET /health, GET /metrics, POST
/tokenize, POST /detokenize.

Every request is parsed and validated here (tokenized too, so usage counts and
the max_model_len check need no engine round trip); the engine's own checks
run when it admits the request, and the handler waits for that first answer
before it starts a response, so an invalid request always gets a 4xx with
OpenAI's error JSON. A client that disconnects aborts its requests at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyrunner.engine.async_llm import AsyncLLM, EngineDeadError, EngineNotAcceptingError, RequestStream
from polyrunner.outputs import CompletionOutput, RequestOutput
from polyrunner.sampling_params import SamplingParams
from polyrunner.tools.serve import protocol as P
from polyrunner.tools.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})
_RESERVED_TEMPLATE_ARGS = frozenset({"messages", "chat_template", "tools", "documents", "add_generation_prompt"})
DEFAULT_MAX_BODY_BYTES = 4 << 20


def build_app(async_llm: AsyncLLM, *, served_model_names: list[str] | None = None, api_key: str | None = None,
              max_waiting: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown_timeout: float | None = None, retry_after_s: int = 1) -> FastAPI:
    """The app. `max_waiting`: answer 503 + Retry-After once this many requests wait
    for a slot. `shutdown_timeout`: when not None, the app owns `async_llm` and
    drains then shuts it down (that many seconds at most) when the app stops."""
    names = list(served_model_names or ["polyrunner"])
    server = _Server(async_llm, names, max_waiting, retry_after_s, ServerMetrics(async_llm, names[0]))
    async_llm.add_stats_listener(server.metrics.on_step)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if shutdown_timeout is not None:
                await async_llm.shutdown_async(shutdown_timeout)
            async_llm.remove_stats_listener(server.metrics.on_step)

    app = FastAPI(title="polyrunner", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(P.RequestError)
    async def _request_error(request: Request, exc: P.RequestError) -> Response:
        headers = {"Retry-After": str(retry_after_s)} if exc.status == 503 else None
        return _json(exc.response(), exc.status, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = P.RequestError(str(exc.detail), status=exc.status_code,
                             code="not_found" if exc.status_code == 404 else None)
        return _json(err.response(), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s", request.url.path)
        err = P.RequestError(f"internal server error: {type(exc).__name__}: {exc}", status=500,
                             type="server_error")
        return _json(err.response(), 500)

    @app.get("/health")
    async def health() -> Response:
        if not async_llm.is_healthy:
            reason = str(async_llm.dead_error or "the engine is not running")
            return _json(P.RequestError(reason, status=503, type="server_error").response(), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [P.ModelCard(id=n, root=names[0], max_model_len=async_llm.max_model_len) for n in names]
        return _json(P.ModelList(data=cards))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await _parse(request, P.TokenizeRequest)
        server.check_model(req.model)
        tok = server.need_tokenizer("prompt" if req.prompt is not None else "messages")
        if (req.prompt is None) == (req.messages is None):
            raise P.RequestError("give exactly one of 'prompt' and 'messages'", "prompt")
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = tok.encode(server.render_chat(req.messages, req.add_generation_prompt, None),
                             add_special_tokens=False)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return _json(P.TokenizeResponse(count=len(ids), max_model_len=async_llm.max_model_len, tokens=ids,
                                        token_strs=strs))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await _parse(request, P.DetokenizeRequest)
        server.check_model(req.model)
        tok = server.need_tokenizer("tokens")
        server.check_ids(req.tokens, "tokens")
        return _json(P.DetokenizeResponse(prompt=tok.decode(req.tokens)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, P.CompletionRequest)
        model = server.check_model(req.model)
        params = req.sampling_params()
        prompts = [server.prompt(p, "prompt") for p in req.prompts()]
        call = await server.start(request, "cmpl", prompts, params)
        fmt = _CompletionFormat(server, call, req, model)
        if req.stream:
            return _sse(call, fmt.stream())
        return await call.finish_with(fmt.response)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, P.ChatCompletionRequest)
        model = server.check_model(req.model)
        server.need_tokenizer("messages")
        text = server.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        prompt = server.prompt(text, "messages", add_special_tokens=False)
        params = req.sampling_params(async_llm.max_model_len - len(prompt["prompt_token_ids"]))
        call = await server.start(request, "chatcmpl", [prompt], params)
        fmt = _ChatFormat(server, call, req, model)
        if req.stream:
            return _sse(call, fmt.stream())
        return await call.finish_with(fmt.response)

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


# ------------------------------------------------------------------------ helpers


def _json(model: BaseModel | dict, status: int = 200, headers: dict | None = None) -> Response:
    body = model.model_dump_json() if isinstance(model, BaseModel) else json.dumps(model)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def _parse(request: Request, cls: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        return cls.model_validate_json(body or b"null")
    except ValidationError as exc:
        raise P.validation_error(exc) from None


class _Server:
    """What the handlers share: the engine, names, limits and metrics."""

    def __init__(self, async_llm: AsyncLLM, names: list[str], max_waiting: int | None, retry_after_s: int,
                 metrics: ServerMetrics) -> None:
        self.llm = async_llm
        self.names = names
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.vocab_size = async_llm.engine.arch.vocab_size

    def check_model(self, model: str | None) -> str:
        if model is None or model == "":
            return self.names[0]
        if model not in self.names:
            raise P.RequestError(f"The model `{model}` does not exist.", "model", 404, "model_not_found")
        return model

    def need_tokenizer(self, param: str):
        tok = self.llm.tokenizer
        if tok is None:
            raise P.RequestError("this model has no tokenizer: send token ids instead of text", param)
        return tok

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise P.RequestError(f"token id {bad[0]} is out of vocabulary (allowed: [0, {self.vocab_size - 1}])",
                                 param)

    def render_chat(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                    kwargs: dict[str, Any] | None) -> str:
        tok = self.need_tokenizer("messages")
        # template variables only: a request may not swap the template or its inputs
        extra = {k: v for k, v in (kwargs or {}).items() if k not in _RESERVED_TEMPLATE_ARGS}
        try:
            return tok.apply_chat_template([m.for_template() for m in messages],
                                           add_generation_prompt=add_generation_prompt, **extra)
        except Exception as exc:   # the template's raise_exception, a bad template variable, ...
            raise P.RequestError(f"the chat template cannot render these messages: {exc}", "messages") from None

    def prompt(self, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> dict[str, Any]:
        """A prompt as the engine takes it (text and ids), checked against max_model_len."""
        if isinstance(prompt, str):
            if not prompt:
                raise P.RequestError("prompt must not be empty", param)
            ids = self.need_tokenizer(param).encode(prompt, add_special_tokens=add_special_tokens)
            text: str | None = prompt
        else:
            ids, text = list(prompt), None
            if not ids:
                raise P.RequestError("prompt must not be empty", param)
            self.check_ids(ids, param)
        limit = self.llm.max_model_len
        if len(ids) >= limit:
            raise P.RequestError(f"This model's maximum context length is {limit} tokens. However, your "
                                 f"prompt has {len(ids)} tokens; it may have at most {limit - 1}.",
                                 param, code="context_length_exceeded")
        return {"prompt": text, "prompt_token_ids": ids}

    async def start(self, request: Request, prefix: str, prompts: list[dict[str, Any]],
                    params: SamplingParams) -> _Call:
        """Admit the prompts (together: they join the same engine step) and wait for
        the engine to accept them; engine-side rejections become 4xx."""
        if not self.llm.is_healthy:
            raise P.RequestError(str(self.llm.dead_error or "the engine is not running"), None, 503,
                                 type="server_error")
        if self.max_waiting is not None and self.llm.num_waiting >= self.max_waiting:
            raise P.RequestError(f"the server is busy: {self.llm.num_waiting} requests are waiting "
                                 f"(limit {self.max_waiting}); retry later", None, 503, "server_busy",
                                 type="server_error")
        rid = P.random_id(prefix)
        try:
            with self.llm.batch():
                streams = [self.llm.add_request(p, params, rid if len(prompts) == 1 else f"{rid}-{i}")
                           for i, p in enumerate(prompts)]
        except EngineNotAcceptingError as exc:
            raise P.RequestError(str(exc), None, 503, "shutting_down", type="server_error") from None
        except EngineDeadError as exc:
            raise P.RequestError(str(exc), None, 503, type="server_error") from None
        call = _Call(self.llm, rid, prompts, streams, request)
        try:
            await call.first()
        except BaseException:
            call.abort()
            call.close()
            raise
        return call


@dataclass
class _Event:
    index: int                 # which prompt
    output: RequestOutput


class _Call:
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
                raise _engine_error(r)
            self.latest[i] = r

    async def events(self) -> AsyncIterator[_Event]:
        """The first outputs, then every later one as it comes (prompts interleaved)."""
        for i, out in enumerate(self.latest):
            yield _Event(i, out)
        pending = {i for i, s in enumerate(self.streams) if not s.done}
        if len(pending) == 1:
            (i,) = pending
            async for out in self.streams[i]:
                self.latest[i] = out
                yield _Event(i, out)
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
                    yield _Event(i, out)
        finally:
            for task in tasks:
                task.cancel()

    async def finish_with(self, build) -> Response:
        """Non-streamed: wait for every request to finish, then `build()` the body."""
        try:
            async for _ in self.events():
                pass
        except Exception as exc:
            raise _engine_error(exc) from None
        finally:
            self.abort()
            self.close()
        return _json(build())

    def abort(self) -> None:
        for s in self.streams:
            if not s.done:
                self.llm.abort(s.request_id)

    def close(self) -> None:
        self._watch.cancel()


def _engine_error(exc: BaseException) -> BaseException:
    if isinstance(exc, P.RequestError):
        return exc
    if isinstance(exc, EngineDeadError):
        return P.RequestError(str(exc), None, 503, type="server_error")
    if isinstance(exc, ValueError):
        return P.RequestError(str(exc), _param_of(str(exc)))
    return exc


def _param_of(message: str) -> str | None:
    """Which request field an engine message is about (best effort): the first
    SamplingParams field named in its first clause, else the prompt if named."""
    words = re.findall(r"[a-z_]+", message.removeprefix("invalid SamplingParams: ").split(";", 1)[0])
    for word in words:
        if word in SamplingParams.model_fields:
            return word
    return "prompt" if any(w.startswith("prompt") for w in words) else None


def _sse(call: _Call, chunks: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:   # the engine died or refused mid-stream: tell the client, end cleanly
            err = _engine_error(exc)
            if not isinstance(err, P.RequestError):
                logger.exception("stream failed")
                err = P.RequestError(f"{type(exc).__name__}: {exc}", status=500, type="server_error")
            yield f"data: {err.response().model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            call.abort()
            call.close()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _data(model: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def _usage(call: _Call) -> P.UsageInfo:
    prompt = sum(len(p["prompt_token_ids"]) for p in call.prompts)
    completion = sum(len(c.token_ids) for out in call.latest if out is not None for c in out.outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class _Format:
    """Turns cumulative outputs into OpenAI choices and stream deltas."""

    def __init__(self, server: _Server, call: _Call, req: P._SamplingRequest, model: str) -> None:
        self.server = server
        self.call = call
        self.req = req
        self.model = model
        self.tok = server.llm.tokenizer
        self.n = req.n
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # a chunk without new text still matters when it carries logprobs or token ids
        self.wants_tokens = bool(req.logprobs is not None and req.logprobs is not False) or req.return_token_ids
        # per choice: text and token count already sent, finished sent
        self._sent: dict[int, tuple[int, int, bool]] = {}

    def token_str(self, tid: int, lp) -> str:
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{tid}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None else f"token_id:{tid}"

    def deltas(self, event: _Event) -> list[tuple[int, CompletionOutput, str, int, bool]]:
        """(choice index, completion, new text, first new token, first chunk) for each
        completion with something new since the last call."""
        out = []
        for c in event.output.outputs:
            index = event.index * self.n + c.index
            text_len, n_tokens, done = self._sent.get(index, (0, 0, False))
            first = index not in self._sent
            if done:
                continue
            new_text = c.text[text_len:]
            new_tokens = self.wants_tokens and len(c.token_ids) > n_tokens
            if not (new_text or new_tokens or c.finished or first):
                continue
            self._sent[index] = (len(c.text), len(c.token_ids), c.finished)
            out.append((index, c, new_text, n_tokens, first))
        return out

    def usage_chunk(self, cls) -> str:
        return _data(cls(id=self.call.id, created=self.call.created, model=self.model, choices=[],
                         usage=_usage(self.call)))


class _CompletionFormat(_Format):
    req: P.CompletionRequest

    def logprobs(self, c: CompletionOutput, start: int, offset: int) -> P.CompletionLogProbs | None:
        if c.logprobs is None:
            return None
        lp = P.CompletionLogProbs()
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            chosen = entry.get(tid)
            s = self.token_str(tid, chosen)
            lp.tokens.append(s)
            lp.token_logprobs.append(chosen.logprob if chosen is not None else None)
            lp.top_logprobs.append({self.token_str(t, x): max(x.logprob, -9999.0) for t, x in entry.items()})
            lp.text_offset.append(offset)
            offset += len(s)
        return lp

    def choice(self, index: int, c: CompletionOutput, text: str, start: int, prompt: dict, first: bool,
               offset: int) -> P.CompletionChoice:
        ids = self.req.return_token_ids
        return P.CompletionChoice(
            index=index, text=text, logprobs=self.logprobs(c, start, offset), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, token_ids=c.token_ids[start:] if ids else None,
            prompt_token_ids=prompt["prompt_token_ids"] if ids and first else None)

    def _echo(self, prompt: dict) -> str:
        if not self.req.echo:
            return ""
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        return self.tok.decode(prompt["prompt_token_ids"]) if self.tok is not None else ""

    def response(self) -> P.CompletionResponse:
        choices = []
        for i, out in enumerate(self.call.latest):
            prompt = self.call.prompts[i]
            echo = self._echo(prompt)
            for c in out.outputs:
                choices.append(self.choice(i * self.n + c.index, c, echo + c.text, 0, prompt, True, len(echo)))
        return P.CompletionResponse(id=self.call.id, created=self.call.created, model=self.model,
                                    choices=choices, usage=_usage(self.call))

    async def stream(self) -> AsyncIterator[str]:
        exclude = None if self.include_usage else {"usage"}
        async for event in self.call.events():
            prompt = self.call.prompts[event.index]
            choices = []
            for index, c, text, start, first in self.deltas(event):
                echo = self._echo(prompt) if first else ""
                offset = len(c.text) - len(text)
                choices.append(self.choice(index, c, echo + text, start, prompt, first, offset))
            if choices:
                yield _data(P.CompletionChunk(id=self.call.id, created=self.call.created, model=self.model,
                                              choices=choices), exclude)
        if self.include_usage:
            yield self.usage_chunk(P.CompletionChunk)
        yield "data: [DONE]\n\n"


class _ChatFormat(_Format):
    req: P.ChatCompletionRequest

    def logprobs(self, c: CompletionOutput, start: int) -> P.ChatLogProbs | None:
        if c.logprobs is None:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            chosen = entry.get(tid)
            s = self.token_str(tid, chosen)
            top = sorted(((t, x) for t, x in entry.items() if x.rank is not None and x.rank <= k),
                         key=lambda tx: tx[1].rank)[:k]
            content.append(P.TokenLogprob(
                token=s, logprob=max(chosen.logprob, -9999.0) if chosen else -9999.0, bytes=list(s.encode()),
                top_logprobs=[P.TopLogprob(token=(ts := self.token_str(t, x)), logprob=max(x.logprob, -9999.0),
                                           bytes=list(ts.encode())) for t, x in top]))
        return P.ChatLogProbs(content=content)

    def response(self) -> P.ChatCompletionResponse:
        out = self.call.latest[0]
        ids = self.req.return_token_ids
        choices = [P.ChatChoice(index=c.index, message=P.ChatMessageOut(content=c.text),
                                logprobs=self.logprobs(c, 0), finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason, token_ids=list(c.token_ids) if ids else None)
                   for c in out.outputs]
        return P.ChatCompletionResponse(id=self.call.id, created=self.call.created, model=self.model,
                                        choices=choices, usage=_usage(self.call),
                                        prompt_token_ids=self.call.prompts[0]["prompt_token_ids"] if ids else None)

    async def stream(self) -> AsyncIterator[str]:
        exclude = None if self.include_usage else {"usage"}
        call, ids = self.call, self.req.return_token_ids

        def chunk(choices: list[P.ChatChunkChoice]) -> str:
            return _data(P.ChatCompletionChunk(id=call.id, created=call.created, model=self.model,
                                               choices=choices), exclude)

        # the first chunk of every choice carries the role (OpenAI), no content yet
        yield chunk([P.ChatChunkChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                     for i in range(self.n)])
        async for event in call.events():
            choices = []
            for index, c, text, start, _ in self.deltas(event):
                choices.append(P.ChatChunkChoice(
                    index=index, delta=P.DeltaMessage(content=text), logprobs=self.logprobs(c, start),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason if c.finished else None,
                    token_ids=c.token_ids[start:] if ids else None))
            if choices:
                yield chunk(choices)
        if self.include_usage:
            yield self.usage_chunk(P.ChatCompletionChunk)
        yield "data: [DONE]\n\n"


# ------------------------------------------------------------------- ASGI guard


class _Guard:
    """Outermost ASGI layer: the request-body size limit (413) and the API key (401).
    It buffers a POST body (up to the limit) and replays it to the app; later
    receives go to the server, so the app still sees the client disconnect."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                err = P.RequestError("Incorrect API key provided.", None, 401, "invalid_api_key")
                await _send(send, 401, err.response(), {"WWW-Authenticate": "Bearer"})
                return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        too_big = P.RequestError(f"the request body exceeds the limit of {self.max_body_bytes} bytes",
                                 None, 413, "request_too_large")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send(send, 413, too_big.response())
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _send(send, 413, too_big.response())
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send(send, status: int, body: BaseModel, headers: dict[str, str] | None = None) -> None:
    raw = body.model_dump_json().encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw, "more_body": False})
