"""Request and response bodies of the OpenAI-compatible API (OpenAI's field names,
plus vLLM's sampling extras), and their mapping onto `SamplingParams`.

Requests are strict: a wrong JSON type is an error (no "5" for 5), and a field
the API does not know is refused the way OpenAI refuses it ("Unrecognized
request argument supplied: ...").
"""

from __future__ import annotations

import functools
import itertools
import reprlib
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.types import FailFast
from pydantic_core import from_json

from polyrunner.sampling_params import SamplingParams, SamplingParamsError
from polyrunner.structured import StructuredOutputsParams

MAX_REPORTED_ERRORS = 5       # a 400 names at most this many invalid fields or elements


class _ShortRepr(reprlib.Repr):
    """A bounded repr of a (JSON) value: the first few items, in order (reprlib would sort a dict's keys)."""

    def repr_dict(self, x: dict, level: int) -> str:
        if not x or level <= 0:
            return "{" + (self.fillvalue if x else "") + "}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces + ([self.fillvalue] if len(x) > self.maxdict else [])) + "}"


_REPR = _ShortRepr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = 4
_REPR.maxlevel = 2


class _FailFast(FailFast):
    """pydantic's FailFast, hashable (typing deduplicates union members by hash)."""

    __hash__ = object.__hash__


_FIRST_ERROR = _FailFast()
# Containers that stop at their first invalid element: a 3 MB list of bad items is one error, not a
# million (pydantic would otherwise build, and we would report, an error per element).
IntList = Annotated[list[int], _FIRST_ERROR]
StrList = Annotated[list[str], _FIRST_ERROR]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_fields(cls, data: Any) -> Any:
        """Pass pydantic at most MAX_REPORTED_ERRORS unknown fields (each is one error)."""
        known = _known_fields(cls)
        if isinstance(data, dict) and len(data) > len(known) + MAX_REPORTED_ERRORS:
            unknown = set(itertools.islice((k for k in data if k not in known), MAX_REPORTED_ERRORS))
            data = {k: v for k, v in data.items() if k in known or k in unknown}
        return data


@functools.cache
def _known_fields(cls: type[BaseModel]) -> frozenset[str]:
    return frozenset(n for name, f in cls.model_fields.items() for n in (name, f.alias) if n)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


def _opt(default: Any = None, **kw: Any) -> Any:
    """A response field left out of the JSON while it is None (vLLM's extras)."""
    return Field(default, exclude_if=lambda v: v is None, **kw)


# ---------------------------------------------------------------------- requests


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`."""

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: "text", "json_object" or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Request):
    """vLLM's `structured_outputs` extra body field (StructuredOutputsParams' fields)."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: StrList | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | StrList | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], _FIRST_ERROR] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: IntList | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False               # token ids in the response (vLLM)
    return_tokens_as_token_ids: bool = False     # logprob tokens as "token_id:N" (vLLM)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None   # vLLM's extra body field

    def _structured(self) -> tuple[StructuredOutputsParams | None, str]:
        """The output constraint and the field it came from: `response_format` (json_schema
        -> json, json_object -> json_object, text -> none) or vLLM's `structured_outputs`.
        Any invalid constraint is a RequestError naming that field."""
        fmt, body = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and body is not None:
            raise RequestError("give at most one of response_format and structured_outputs", "response_format")
        param = "structured_outputs" if body is not None else "response_format"
        try:
            if body is not None:
                if isinstance(body.json_, str):
                    _check_json_text(body.json_)
                return StructuredOutputsParams(**body.model_dump(by_alias=True)), param
            if fmt is None or fmt.type == "text":
                return None, ""
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True), param
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise RequestError("response_format of type json_schema needs json_schema.schema",
                                   "response_format.json_schema")
            return StructuredOutputsParams(json=fmt.json_schema.json_schema), param
        except RequestError:
            raise
        except RecursionError:
            raise RequestError("the schema is nested too deeply", param) from None
        except (ValueError, TypeError) as exc:
            raise RequestError(str(exc), param) from None

    def param_names(self) -> dict[str, str]:
        """Engine-side parameter -> the request field it came from, where they differ (so an
        engine error's `param` names what the client sent)."""
        names = {}
        if self.response_format is not None and self.response_format.type != "text":
            names["structured_outputs"] = "response_format"
        if getattr(self, "max_completion_tokens", None) is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                values[name] = value
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    bias[int(key)] = value
                except ValueError:
                    raise RequestError(f"logit_bias keys must be token ids (got {key!r})", "logit_bias") from None
            values["logit_bias"] = bias
        structured, _ = self._structured()
        if structured is not None:
            values["structured_outputs"] = structured
        try:
            return SamplingParams(**values)
        except SamplingParamsError as exc:
            raise RequestError(str(exc), _sampling_param(exc, self)) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | StrList | IntList | Annotated[list[IntList], _FIRST_ERROR]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            prompts: list = [p]
        elif p and isinstance(p[0], int):   # validated: a list holds one kind of item
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise RequestError("prompt must not be empty", "prompt")
        return prompts

    def sampling_params(self) -> SamplingParams:
        if self.suffix is not None:
            raise RequestError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported (it must be absent or equal n)", "best_of")
        if self.echo and self.logprobs is not None:
            raise RequestError("echo together with logprobs is not supported", "echo")
        return self._sampling(self.max_tokens, self.logprobs)


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], _FIRST_ERROR] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = "".join(part.text for part in self.content)
        msg.setdefault("content", "")
        return msg


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], _FIRST_ERROR] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def sampling_params(self, room: int) -> SamplingParams:
        """`room`: tokens left in max_model_len after the prompt (the default max_tokens)."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise RequestError(f"top_logprobs must be in [0, 20] (got {self.top_logprobs})", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling(max_tokens if max_tokens is not None else max(room, 1), logprobs)
        except RequestError as exc:
            if exc.param == "max_tokens" and self.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], _FIRST_ERROR] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: IntList


class LoadLoRAAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's body; `lora_int_id` is accepted and not needed)."""

    lora_name: str
    lora_int_id: int | None = None


# --------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = _opt()
    token_ids: list[int] | None = _opt()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogProbs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _opt()


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = _opt()


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _opt()
    content: str | None = _opt()


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = _opt()
    token_ids: list[int] | None = _opt()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "polyrunner"
    root: str | None = None
    parent: str | None = None          # an adapter's base model (vLLM's)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = _opt()


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -------------------------------------------------------------------- errors


class RequestError(ValueError):
    """An invalid request: answered with `status` and OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))


def _loc_to_param(loc: tuple) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union member tags left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not _is_type_tag(part):
            out += f".{part}" if out else part
    return out or None


def _is_type_tag(part: str) -> bool:
    return ("[" in part or part in {"str", "int", "float", "bool", "none", "list", "dict", "dict[str,any]"}
            or part.startswith(("function-", "literal[", "nullable[", "model-")) or part[:1].isupper())


def validation_error(exc: ValidationError) -> RequestError:
    """A pydantic error of a request body -> one 400 naming the field(s): at most
    MAX_REPORTED_ERRORS of them, each with a short repr of the value it got (never the whole input)."""
    errors = exc.errors(include_url=False, include_context=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return RequestError("We could not parse the JSON body of your request. The API expects a JSON "
                            f"payload ({errors[0]['msg']}).", None, code="invalid_json")
    if any(e["type"] == "model_type" and not e["loc"] for e in errors):
        return RequestError("The request body must be a JSON object.", None)
    seen: dict[str, str] = {}   # a union reports one error per member: the first one per field is shown
    for e in errors:
        param = _loc_to_param(e["loc"]) or ""
        if param in seen:
            continue
        if e["type"] == "extra_forbidden":
            seen[param] = f"Unrecognized request argument supplied: {param}"
        elif e["type"] == "missing":
            seen[param] = f"Missing required parameter: '{param}'."
        elif "input" in e:
            seen[param] = f"Invalid value for '{param}': {e['msg']} (got {_REPR.repr(e['input'])})"
        else:
            seen[param] = e["msg"]
    shown = list(seen.values())[:MAX_REPORTED_ERRORS]
    more = len(seen) - len(shown)
    message = "; ".join(shown) + (f"; and {more} more invalid field(s)" if more else "")
    return RequestError(message, next(iter(seen)) or None)


def _check_json_text(text: str) -> None:
    """A schema sent as a JSON string parses within the request body's own nesting limit."""
    try:
        from_json(text)
    except ValueError as exc:
        raise RequestError(f"structured_outputs.json must be a JSON schema (a dict or a JSON string); "
                           f"the string does not parse: {exc}", "structured_outputs") from None


def _sampling_param(exc: SamplingParamsError, req: _SamplingRequest) -> str | None:
    """Which request field a SamplingParams error is about."""
    for err in exc.errors:
        loc = err.get("loc") or ()
        if loc:
            return str(loc[0])
        msg = str(err.get("ctx", {}).get("error", err.get("msg", "")))
        name = msg.split(" ", 1)[0]
        if name in SamplingParams.model_fields:
            return name
    text = str(exc).removeprefix("invalid SamplingParams: ")
    name = text.split(" ", 1)[0]
    return name if name in SamplingParams.model_fields else None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
