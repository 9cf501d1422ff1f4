"""What callers get back: vLLM-shaped request outputs."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the sampled/actual token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a request: vLLM's fields in vLLM's order, `finished()` a method as there."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None          # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None
    lora_request: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(init=False)
class RequestOutput:
    """One request's output (cumulative while it runs).

    Takes vLLM's keyword arguments: `metrics`, `lora_request`, `encoder_prompt`,
    `encoder_prompt_token_ids` are kept as given; any other keyword is ignored with
    one warning per distinct set, as vLLM's forward-compatible `**kwargs`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    error: str | None                        # set when the request was rejected or failed
    metrics: Any = None
    lora_request: Any = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 prompt_logprobs: list[PositionLogprobs | None] | None = None,
                 outputs: list[CompletionOutput] | None = None, finished: bool = False,
                 metrics: Any = None, lora_request: Any = None, encoder_prompt: str | None = None,
                 encoder_prompt_token_ids: list[int] | None = None, num_cached_tokens: int | None = 0,
                 *, error: str | None = None, **kwargs: Any) -> None:
        if kwargs:
            _warn_once(f"RequestOutput: Ignoring extra arguments: {kwargs}")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids if prompt_token_ids is not None else []
        self.outputs = outputs if outputs is not None else []
        self.prompt_logprobs = prompt_logprobs
        self.finished = finished
        self.num_cached_tokens = num_cached_tokens if num_cached_tokens is not None else 0
        self.error = error
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids


@functools.lru_cache(maxsize=64)
def _warn_once(message: str) -> None:
    logger.warning(message)
