"""The OpenAI-compatible HTTP API over an `AsyncLLM` (FastAPI): the app and its endpoints.

`build_app(async_llm, ...)` returns the app; `polyrunner serve` runs it with
uvicorn (launcher.py). Endpoints: POST /v1/completions, POST
/v1/chat/completions, GET /v1/models, GET /health, GET /metrics, POST
/tokenize, POST /detokenize.

Every request is parsed and validated here (tokenized too, so usage counts and
the max_model_len check need no engine round trip); one call's life (engine
admission, events, disconnects, errors) is in `calls.py`, the OpenAI response
and stream formats in `formats.py`, the API key and body limit in `guard.py`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from polyrunner.engine.async_llm import AsyncLLM, EngineDeadError, EngineNotAcceptingError
from polyrunner.sampling_params import SamplingParams
from polyrunner.tools.serve import protocol as P
from polyrunner.tools.serve.calls import Call, json_response
from polyrunner.tools.serve.formats import ChatFormat, CompletionFormat, sse
from polyrunner.tools.serve.guard import Guard
from polyrunner.tools.serve.metrics import ServerMetrics
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_RESERVED_TEMPLATE_ARGS = frozenset({"messages", "chat_template", "tools", "documents", "add_generation_prompt"})
DEFAULT_MAX_BODY_BYTES = 4 << 20


def build_app(async_llm: AsyncLLM, *, served_model_names: list[str] | None = None, api_key: str | None = None,
              max_waiting: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown_timeout: float | None = None, retry_after_s: int = 1) -> FastAPI:
    """The app. `max_waiting`: answer 503 + Retry-After once this many requests wait
    for a slot. `shutdown_timeout`: when not None, the app owns `async_llm` and
    drains then shuts it down (that many seconds at most) when the app stops."""
    names = list(served_model_names or ["polyrunner"])
    server = Server(async_llm, names, max_waiting, retry_after_s, ServerMetrics(async_llm, names[0]))
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
        return json_response(exc.response(), exc.status, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = P.RequestError(str(exc.detail), status=exc.status_code,
                             code="not_found" if exc.status_code == 404 else None)
        return json_response(err.response(), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s", request.url.path)
        err = P.RequestError(f"internal server error: {type(exc).__name__}: {exc}", status=500,
                             type="server_error")
        return json_response(err.response(), 500)

    @app.get("/health")
    async def health() -> Response:
        if not async_llm.is_healthy:
            reason = str(async_llm.dead_error or "the engine is not running")
            return json_response(P.RequestError(reason, status=503, type="server_error").response(), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [P.ModelCard(id=n, root=names[0], max_model_len=async_llm.max_model_len) for n in names]
        return json_response(P.ModelList(data=cards))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, P.TokenizeRequest)
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
        return json_response(P.TokenizeResponse(count=len(ids), max_model_len=async_llm.max_model_len, tokens=ids,
                                        token_strs=strs))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, P.DetokenizeRequest)
        server.check_model(req.model)
        tok = server.need_tokenizer("tokens")
        server.check_ids(req.tokens, "tokens")
        return json_response(P.DetokenizeResponse(prompt=tok.decode(req.tokens)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, P.CompletionRequest)
        model = server.check_model(req.model)
        params = req.sampling_params()
        prompts = [server.prompt(p, "prompt") for p in req.prompts()]
        call = await server.start(request, "cmpl", prompts, params)
        fmt = CompletionFormat(async_llm.tokenizer, call, req, model)
        if req.stream:
            return sse(call, fmt.stream())
        return await call.finish_with(fmt.response)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, P.ChatCompletionRequest)
        model = server.check_model(req.model)
        server.need_tokenizer("messages")
        text = server.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        prompt = server.prompt(text, "messages", add_special_tokens=False)
        params = req.sampling_params(async_llm.max_model_len - len(prompt["prompt_token_ids"]))
        call = await server.start(request, "chatcmpl", [prompt], params)
        fmt = ChatFormat(async_llm.tokenizer, call, req, model)
        if req.stream:
            return sse(call, fmt.stream())
        return await call.finish_with(fmt.response)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


# ------------------------------------------------------------------------ helpers


async def parse_body(request: Request, cls: type[BaseModel]) -> Any:
    body = await request.body()
    try:
        return cls.model_validate_json(body or b"null")
    except ValidationError as exc:
        raise P.validation_error(exc) from None


class Server:
    """What the handlers share: the engine, names, limits and metrics."""

    def __init__(self, async_llm: AsyncLLM, names: list[str], max_waiting: int | None, retry_after_s: int,
                 metrics: ServerMetrics) -> None:
        self.llm = async_llm
        self.names = names
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.vocab_size = async_llm.vocab_size

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
                    params: SamplingParams) -> Call:
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
        call = Call(self.llm, rid, prompts, streams, request)
        try:
            await call.first()
        except BaseException:
            call.abort()
            call.close()
            raise
        return call
