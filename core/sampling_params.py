"""Per-request sampling parameters, with vLLM's names and defaults.

`SamplingParams` validates every field on construction (and on assignment);
an out-of-range value raises `SamplingParamsError` (a `ValueError`) whose
message names the field, the allowed range and the value it got. Checks that
need the vocabulary size live in `validate_for_vocab`, which the engine calls
before scheduling a request.

`features()` names the sampling features a request needs, so the engine can
reject a request that the backend cannot run on its device (the feature names
are `polyrunner.device.backend.SAMPLING_FEATURES`).
"""

from __future__ import annotations

import copy
import enum
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from polyrunner.structured.params import StructuredOutputsParams

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class SamplingParamsError(ValueError):
    """Invalid sampling parameters; the message names each offending field."""

    def __init__(self, message: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.errors = errors or []

    @classmethod
    def from_validation_error(cls, exc: ValidationError) -> "SamplingParamsError":
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            if err["type"] == "value_error":  # our own checks: complete, named after the field if they are not
                text = str(err["ctx"]["error"])
                top = str(err["loc"][0]) if err["loc"] else ""
                lines.append(text if not top or text.startswith(top) else f"{field}: {text}")
            else:
                got = f" (got {err['input']!r})" if "input" in err else ""
                lines.append(f"{field or 'SamplingParams'}: {err['msg']}{got}")
        return cls("invalid SamplingParams: " + "; ".join(lines), exc.errors())


class Tokenizer(Protocol):
    """What `bad_words_token_ids` needs: HF `PreTrainedTokenizer` or `tokenizers.Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...


def _finite(name: str, v: float) -> float:
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number (got {v!r})")
    return v


def _range(name: str, v: float, lo: float | None, hi: float | None,
           lo_open: bool = False, hi_open: bool = False) -> float:
    """Check lo <= v <= hi (or < when open); the message states the range."""
    _finite(name, v)
    if lo is not None and hi is not None:
        ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            raise ValueError(f"{name} must be in {interval} (got {v!r})")
    elif lo is not None:
        if not (v > lo if lo_open else v >= lo):
            raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo:g} (got {v!r})")
    return v


def logits_processor_takes_prompt(fn: Callable[..., Any]) -> bool:
    """vLLM V0's rule: a processor with 3 parameters is called as
    `fn(prompt_token_ids, output_token_ids, logits_row)`, else `fn(output_token_ids, logits_row)`."""
    return len(inspect.signature(fn).parameters) == 3


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    enc = tokenizer.encode(text, add_special_tokens=False)
    return [int(t) for t in getattr(enc, "ids", enc)]


class SamplingParams(BaseModel):
    """How to sample one request (vLLM-compatible names and defaults)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: off (-1 is stored as 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16          # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = []                 # None or a single string are normalised to a list
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None          # -1: the full vocabulary
    prompt_logprobs: int | None = None   # -1: the full vocabulary
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # vLLM V0's per-request logits processors: `fn(output_token_ids, logits_row)` or
    # `fn(prompt_token_ids, output_token_ids, logits_row)` -> the new logits_row (a [V]
    # float tensor on the backend's device), applied before every other processor.
    logits_processors: list[Callable[..., Any]] | None = None
    # the output must match a JSON schema, regex, choice or grammar (vLLM's name); a dict is
    # read as StructuredOutputsParams(**dict). Compiled when the engine admits the request.
    structured_outputs: StructuredOutputsParams | None = None

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SamplingParamsError.from_validation_error(exc) from None

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get(name)
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            if name in self.__dict__:  # a failed cross-field check must not leave the value set
                self.__dict__[name] = old
            raise SamplingParamsError.from_validation_error(exc) from None

    # ---- field checks ---------------------------------------------------
    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        return int(_range("n", v, 1, None))

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        return _range("temperature", v, 0.0, None)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        return _range("top_p", v, 0.0, 1.0, lo_open=True)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == -1:
            return 0
        if v < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1 (got {v!r})")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v: float) -> float:
        return _range("min_p", v, 0.0, 1.0)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float, info: Any) -> float:
        return _range(info.field_name, v, -2.0, 2.0)

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float) -> float:
        return _range("repetition_penalty", v, 0.0, None, lo_open=True)

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not (_SEED_MIN <= v <= _SEED_MAX):
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1] (got {v!r})")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be >= 1 or None (got {v!r})")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int) -> int:
        if v < 0:   # vLLM's wording
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {v}.")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_to_list(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError(f"stop must not contain an empty string (got {v!r})")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids_to_list(cls, v: Any) -> Any:
        return [] if v is None else v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError(f"stop_token_ids must all be >= 0 (got {v!r})")
        return v

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, v: int | None, info: Any) -> int | None:
        if v is not None and v < -1:
            raise ValueError(f"{info.field_name} must be None, -1 (full vocabulary) or >= 0 (got {v!r})")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return None
        for tok, bias in v.items():
            if tok < 0:
                raise ValueError(f"logit_bias token ids must be >= 0 (got {tok!r})")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100] (got {bias!r} for token {tok})")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("allowed_token_ids must be None or a non-empty list (got [])")
        if min(v) < 0:
            raise ValueError(f"allowed_token_ids must all be >= 0 (got {min(v)!r})")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not w.strip() for w in v):
            raise ValueError(f"bad_words must not contain empty or blank strings (got {v!r})")
        return v

    @field_validator("logits_processors")
    @classmethod
    def _logits_processors(cls, v: list[Callable[..., Any]] | None) -> list[Callable[..., Any]] | None:
        for i, fn in enumerate(v or ()):
            try:
                n = len(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                n = None
            if n not in (2, 3):
                raise ValueError(
                    f"logits_processors[{i}] must take (output_token_ids, logits) or "
                    f"(prompt_token_ids, output_token_ids, logits) (got {fn!r})")
        return v or None

    @model_validator(mode="after")
    def _cross_field(self) -> "SamplingParams":
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:   # vLLM's wording
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        return self

    # ---- checks that need the model -------------------------------------
    def validate_for_vocab(self, vocab_size: int) -> None:
        """Every token id this request names must be in [0, vocab_size)."""

        def check(name: str, ids: Any) -> None:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(
                    f"invalid SamplingParams: {name} must be in [0, {vocab_size}) "
                    f"(the vocabulary size) (got {bad[:8]!r})"
                )

        check("stop_token_ids", self.stop_token_ids)
        if self.logit_bias:
            check("logit_bias token ids", self.logit_bias.keys())
        if self.allowed_token_ids is not None:
            check("allowed_token_ids", self.allowed_token_ids)

    # ---- derived --------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def features(self, logprobs_mode: str = "raw_logprobs") -> set[str]:
        """Sampling features this request needs (a subset of SAMPLING_FEATURES).

        "temperature" means random (non-greedy) sampling. top_k / top_p /
        min_p / seed only matter, and are only reported, for random requests.
        `logprobs_mode`: the engine's; a mode other than "raw_logprobs" is a
        feature of its own for a request that wants (sample) logprobs.
        """
        f: set[str] = set()
        if not self.is_greedy:
            f.add("temperature")
            if self.top_k > 0:
                f.add("top_k")
            if self.top_p < 1.0:
                f.add("top_p")
            if self.min_p > 0.0:
                f.add("min_p")
            if self.seed is not None:
                f.add("seed")
        if self.has_penalties:
            f.add("penalties")
        if self.logit_bias:
            f.add("logit_bias")
        if self.allowed_token_ids is not None:
            f.add("allowed_token_ids")
        if self.bad_words:
            f.add("bad_words")
        if self.logprobs is not None:
            f.add("logprobs")
            if logprobs_mode != "raw_logprobs":
                f.add(logprobs_mode)
        if self.logits_processors:
            f.add("logits_processors")
        if self.prompt_logprobs is not None:
            f.add("prompt_logprobs")
        if self.structured_outputs is not None:
            f.add("structured_outputs")
        return f

    def bad_words_token_ids(self, tokenizer: Tokenizer) -> list[list[int]]:
        """Token sequences to block, vLLM semantics.

        Each bad word is encoded without and with a leading space (so it is
        blocked both at the start of the text and mid-text); the spaced form is
        kept only when it starts with a different token and has the same length
        (a tokenizer that splits off the space adds nothing new). At sampling
        time a sequence blocks its last token only when the preceding tokens
        equal the end of the generated output.
        """
        out: list[list[int]] = []
        for word in self.bad_words or []:
            plain = _encode(tokenizer, word.lstrip())
            if plain:
                out.append(plain)
            spaced = _encode(tokenizer, " " + word.lstrip())
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        return out

    def clone(self) -> "SamplingParams":
        """A deep copy; logits processors are shared (or `.clone()`d where they can), as vLLM V0."""
        memo = {id(fn): fn.clone() if hasattr(fn, "clone") else fn for fn in self.logits_processors or ()}
        return copy.deepcopy(self, memo)


@dataclass
class BeamSearchParams:
    """Parameters of `LLM.beam_search` (vLLM's names and defaults)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
        _range("temperature", self.temperature, 0.0, None)
        _finite("length_penalty", self.length_penalty)
