"""The OpenAI-compatible HTTP API over an `AsyncLLM` (FastAPI): the app and its endpoints.

`build_app(async_llm, ...)` returns the app; `polyrunner serve` runs it with
uvicorn (launcher.py). Endpoints: POST /v1/completions, POST
/v1/chat/completions, GET /v1/models, GET /health, GET /metrics, POST
/tokenize, POST /detokenize, POST /v1/load_lora_adapter, POST
/v1/unload_lora_adapter. LoRA adapters are served as models of their own
(`lora.py`): a request naming one as its `model` runs with it.

Every request is parsed and validated here (tokenized too, so usage counts and
the max_model_len check need no engine round trip), large bodies and prompts in
a thread pool (`offload.py`) so the event loop stays free; one call's life
(engine admission, events, disconnects, errors) is in `calls.py`, the OpenAI
response and stream formats in `formats.py`, the API key, content type and
body limit in `guard.py`.

Admission counts sequences (prompts x n) against `max_waiting`. When uvicorn's
graceful shutdown begins (launcher.py calls `app.state.drain()`), calls still
open after `shutdown_timeout` seconds end with a 503 error (a stream: an error
event, then `data: [DONE]`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyrunner.engine.async_llm import AsyncLLM, EngineDeadError, EngineNotAcceptingError
from polyrunner.engine.engine_loop import sequences
from polyrunner.engine.tokenizer import PromptTooLong
from polyrunner.lora.request import LoRARequest
from polyrunner.sampling_params import SamplingParams
from polyrunner.tools.serve import protocol as P
from polyrunner.tools.serve.calls import Call, json_response
from polyrunner.tools.serve.formats import ChatFormat, CompletionFormat, sse
from polyrunner.tools.serve.guard import Guard
from polyrunner.tools.serve.lora import LoRAModulePath, ServedLoRAs
from polyrunner.tools.serve.metrics import ServerMetrics
from polyrunner.tools.serve.offload import Offload

logger = logging.getLogger(__name__)

_RESERVED_TEMPLATE_ARGS = frozenset({"messages", "chat_template", "tools", "documents", "add_generation_prompt"})
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256


def build_app(async_llm: AsyncLLM, *, served_model_names: list[str] | None = None, api_key: str | None = None,
              max_waiting: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
              shutdown_timeout: float | None = None, retry_after_s: int = 1,
              chat_template: str | None = None, lora_modules: list[LoRAModulePath] | None = None) -> FastAPI:
    """The app. `max_waiting`: answer 503 + Retry-After when a request's sequences
    (prompts x n) would make more than this many wait for a slot.
    `max_prompts_per_request`: 400 above it. `shutdown_timeout`: when not None, the
    app owns `async_llm`: once the server's shutdown begins (`app.state.drain()`),
    calls still open after that many seconds end with a 503, and the app then
    shuts `async_llm` down. `chat_template`: the template chat requests render with
    (vLLM's `--chat-template`; None: the model's own). `lora_modules`: adapters served
    from the start (vLLM's `--lora-modules`), loaded when the app starts; a failure
    stops the start-up (`app.state.startup_error` holds the ValueError)."""
    names = list(served_model_names or ["polyrunner"])
    server = Server(async_llm, names, max_waiting, max_prompts_per_request, retry_after_s,
                    ServerMetrics(async_llm, names[0]))
    server.chat_template = chat_template
    async_llm.add_stats_listener(server.metrics.on_step)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await server.loras.load_static(lora_modules or [])
        except ValueError as exc:
            logger.error("%s", exc)
            app.state.startup_error = exc
            raise
        try:
            yield
        finally:
            if shutdown_timeout is not None:
                await async_llm.shutdown_async(server.time_left(shutdown_timeout))
            async_llm.remove_stats_listener(server.metrics.on_step)
            server.offload.close()

    app = FastAPI(title="polyrunner", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.state.drain = lambda: server.drain(shutdown_timeout)
    app.state.startup_error = None

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
        if async_llm.degraded:   # some data-parallel replica died; the others serve: 200 with what died
            dead = [{"replica": r.index, "pid": r.pid, "error": r.error}
                    for r in async_llm.replica_states() if not r.alive]
            return json_response({"status": "degraded", "replicas": async_llm.data_parallel_size, "dead": dead}, 200)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [P.ModelCard(id=n, root=names[0], max_model_len=async_llm.max_model_len) for n in names]
        return json_response(P.ModelList(data=cards + server.loras.cards()))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        req = await parse_body(request, P.LoadLoRAAdapterRequest, server.offload)
        return Response(await server.loras.load(req.lora_name, req.lora_path), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        req = await parse_body(request, P.UnloadLoRAAdapterRequest, server.offload)
        return Response(await server.loras.unload(req.lora_name), media_type="text/plain")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, P.TokenizeRequest, server.offload)
        server.check_model(req.model)
        tok = server.need_tokenizer("prompt" if req.prompt is not None else "messages")
        if (req.prompt is None) == (req.messages is None):
            raise P.RequestError("give exactly one of 'prompt' and 'messages'", "prompt")
        if req.prompt is not None:
            (ids,) = await server.offload.run(tok.encode_batch, [req.prompt], req.add_special_tokens,
                                              cost=len(req.prompt))
        else:
            _, ids = await server.render_chat(req.messages, req.add_generation_prompt, None,
                                              cost=len(await request.body()))
        strs = (await server.offload.run(tok.convert_ids_to_tokens, ids, cost=len(ids))
                if req.return_token_strs else None)
        return json_response(P.TokenizeResponse(count=len(ids), max_model_len=async_llm.max_model_len, tokens=ids,
                                        token_strs=strs))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, P.DetokenizeRequest, server.offload)
        server.check_model(req.model)
        tok = server.need_tokenizer("tokens")

        def decode() -> str:
            server.check_ids(req.tokens, "tokens")
            return tok.decode_batch([req.tokens])[0]

        text = await server.offload.run(decode, cost=len(req.tokens))
        return json_response(P.DetokenizeResponse(prompt=text))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, P.CompletionRequest, server.offload)
        model = server.check_model(req.model)
        params = req.sampling_params()
        prompts = await server.prompts(req.prompts(), "prompt")
        call = await server.start(request, "cmpl", prompts, params, req.param_names(), server.loras.get(model))
        fmt = CompletionFormat(async_llm.tokenizer, call, req, model)
        if req.stream:
            return sse(call, fmt.stream())
        return await call.finish_with(fmt.response)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, P.ChatCompletionRequest, server.offload)
        model = server.check_model(req.model)
        server.need_tokenizer("messages")
        text, ids = await server.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                             cost=len(await request.body()))
        prompt = server.checked_prompt(text, ids, "messages")
        params = req.sampling_params(async_llm.max_model_len - len(prompt["prompt_token_ids"]))
        call = await server.start(request, "chatcmpl", [prompt], params, req.param_names(),
                                  server.loras.get(model))
        fmt = ChatFormat(async_llm.tokenizer, call, req, model)
        if req.stream:
            return sse(call, fmt.stream())
        return await call.finish_with(fmt.response)

    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


# ------------------------------------------------------------------------ helpers


async def parse_body(request: Request, cls: type[BaseModel], offload: Offload) -> Any:
    """The body as `cls` (a large one validated in the pool); a RequestError if it is not one."""
    body = await request.body()
    return await offload.run(_validate, cls, body, cost=len(body))


def _validate(cls: type[BaseModel], body: bytes) -> Any:
    try:
        return cls.model_validate_json(body or b"null")
    except ValidationError as exc:
        raise P.validation_error(exc) from None


class Server:
    """What the handlers share: the engine, names, limits, metrics, the offload pool
    and the calls still open."""

    def __init__(self, async_llm: AsyncLLM, names: list[str], max_waiting: int | None,
                 max_prompts_per_request: int, retry_after_s: int, metrics: ServerMetrics) -> None:
        self.llm = async_llm
        self.names = names
        self.max_waiting = max_waiting
        self.max_prompts = max_prompts_per_request
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.vocab_size = async_llm.vocab_size
        self.offload = Offload()
        self.loras = ServedLoRAs(async_llm, names, self.offload)
        self.calls: set[Call] = set()
        self._deadline: float | None = None   # loop time at which open calls expire (shutdown)
        self._shut: P.RequestError | None = None   # after the deadline: the answer to every call
        self.chat_template: str | None = None      # the server's --chat-template (None: the model's)

    def check_model(self, model: str | None) -> str:
        """The served name a request's `model` means: a base name or an adapter's (404 otherwise,
        vLLM's answer: an adapter that is not, or no longer, loaded is an unknown model)."""
        if model is None or model == "":
            return self.names[0]
        if model not in self.names and self.loras.get(model) is None:
            raise P.RequestError(f"The model `{model}` does not exist.", "model", 404, "model_not_found")
        return model

    def need_tokenizer(self, param: str):
        tok = self.llm.tokenizer
        if tok is None:
            raise P.RequestError("this model has no tokenizer: send token ids instead of text", param)
        return tok

    def check_ids(self, ids: list[int], param: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):   # C loops; the first bad id only on error
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise P.RequestError(f"token id {bad} is out of vocabulary (allowed: [0, {self.vocab_size - 1}])",
                                 param)

    async def render_chat(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                          kwargs: dict[str, Any] | None, cost: int) -> tuple[str, list[int]]:
        """The chat prompt's text and token ids (rendered and tokenized in the pool when
        `cost`, the body's size, is large)."""
        tok = self.need_tokenizer("messages")
        # template variables only: a request may not swap the template or its inputs
        extra = {k: v for k, v in (kwargs or {}).items() if k not in _RESERVED_TEMPLATE_ARGS}

        def render() -> tuple[str, list[int]]:
            msgs = [m.for_template() for m in messages]
            try:
                text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                               chat_template=self.chat_template, **extra)
            except Exception as exc:   # the template's raise_exception, a bad template variable, ...
                raise P.RequestError(f"the chat template cannot render these messages: {exc}",
                                     "messages") from None
            return text, tok.encode_batch([text], add_special_tokens=False)[0]

        return await self.offload.run(render, cost=cost)

    async def prompts(self, prompts: list[str | list[int]], param: str) -> list[dict[str, Any]]:
        """The prompts as the engine takes them (text and ids; tokenized in the pool when
        long), each checked against max_model_len; at most `max_prompts` of them."""
        if len(prompts) > self.max_prompts:
            raise P.RequestError(f"{param} holds {len(prompts)} prompts; at most {self.max_prompts} are "
                                 "allowed per request", param, code="too_many_prompts")
        if any(isinstance(p, str) for p in prompts):
            self.need_tokenizer(param)
        return await self.offload.run(self._prompts, prompts, param, cost=sum(map(len, prompts)))

    def _prompts(self, prompts: list[str | list[int]], param: str) -> list[dict[str, Any]]:
        texts = [p for p in prompts if isinstance(p, str)]
        if not all(prompts):
            raise P.RequestError(f"{param} must not be empty", param)
        try:
            encoded = iter(self.llm.tokenizer.encode_batch(texts, max_tokens=self.llm.max_model_len - 1)
                           if texts else [])
        except PromptTooLong as e:
            raise self.too_long(e.num_tokens, param) from None
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(self.checked_prompt(p, next(encoded), param))
            else:
                self.check_ids(p, param)
                out.append(self.checked_prompt(None, list(p), param))
        return out

    def checked_prompt(self, text: str | None, ids: list[int], param: str) -> dict[str, Any]:
        """A prompt as the engine takes it, checked against max_model_len."""
        if not ids:
            raise P.RequestError(f"{param} must not be empty", param)
        if len(ids) >= self.llm.max_model_len:
            raise self.too_long(len(ids), param)
        return {"prompt": text, "prompt_token_ids": ids}

    def too_long(self, num_tokens: int, param: str) -> P.RequestError:
        limit = self.llm.max_model_len
        return P.RequestError(f"This model's maximum context length is {limit} tokens. However, your "
                              f"prompt has {num_tokens} tokens; it may have at most {limit - 1}.",
                              param, code="context_length_exceeded")

    async def start(self, request: Request, prefix: str, prompts: list[dict[str, Any]],
                    params: SamplingParams, param_names: dict[str, str] | None = None,
                    lora_request: LoRARequest | None = None) -> Call:
        """Admit the prompts (together: they join the same engine step; with `lora_request`'s
        adapter) and wait for the engine to accept them; engine-side rejections become 4xx."""
        if not self.llm.is_healthy:
            raise P.RequestError(str(self.llm.dead_error or "the engine is not running"), None, 503,
                                 type="server_error")
        if self._shut is not None:
            raise self._shut
        adding = len(prompts) * sequences(params)
        waiting = self.llm.num_waiting
        if self.max_waiting is not None and waiting + adding > self.max_waiting:
            raise P.RequestError(f"the server is busy: {waiting} sequences are waiting and this request adds "
                                 f"{adding} (limit {self.max_waiting}); retry later", None, 503, "server_busy",
                                 type="server_error")
        rid = P.random_id(prefix)
        try:
            with self.llm.batch():
                streams = [self.llm.add_request(p, params, rid if len(prompts) == 1 else f"{rid}-{i}",
                                                lora_request=lora_request)
                           for i, p in enumerate(prompts)]
        except EngineNotAcceptingError as exc:
            raise P.RequestError(str(exc), None, 503, "shutting_down", type="server_error") from None
        except EngineDeadError as exc:
            raise P.RequestError(str(exc), None, 503, type="server_error") from None
        call = Call(self.llm, rid, prompts, streams, request, param_names, self.calls)
        try:
            await call.first()
        except BaseException:
            call.abort()
            call.close()
            raise
        return call

    # ---- shutdown ---------------------------------------------------------------------
    def drain(self, timeout: float | None) -> None:
        """The server's shutdown began (on its loop): calls still open after `timeout`
        seconds end with a 503 "shutting_down" error. None: they may take as long as they need."""
        if timeout is None or self._deadline is not None:
            return
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout
        loop.call_at(self._deadline, self._expire_calls, timeout)

    def time_left(self, timeout: float) -> float:
        """Seconds left of the shutdown (all of `timeout` when `drain` was not called)."""
        if self._deadline is None:
            return timeout
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    def _expire_calls(self, timeout: float) -> None:
        error = P.RequestError(f"the server is shutting down: this request did not finish within the shutdown "
                               f"timeout ({timeout:g} s) and was aborted", None, 503, "shutting_down",
                               type="server_error")
        self._shut = error
        for call in list(self.calls):
            call.expire(error)
