"""The fields of a Hugging Face `config.json` that the decoder reads, validated
(pydantic, strict) before anything is allocated.

Every error names the file and the field, and says what the field allows:

    /m/config.json: config field 'hidden_size' must be an integer >= 1, got '64' (str)

A wrong JSON type raises `ModelConfigTypeError` (a TypeError); a value out of
range, a missing field or fields that do not fit together raise
`ModelFileError` (a ValueError). The type error is a `ModelFileError` too, so
one `except ValueError` catches every bad model file.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Callable, Union

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")   # the gated MLP's (polyrunner.ops.gated_mlp.ACTIVATIONS)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ROPE_TYPE_ALIASES = {"su": "longrope"}   # older Phi-3 configs' name for longrope
# transformers' default for a top-level `original_max_position_embeddings` (which wins over the rope settings')
ORIGINAL_MAX_DEFAULTS = {"phi3": 4096}
LAYER_TYPES = ("full_attention", "sliding_attention")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")   # model types with mixture-of-experts layers


class ModelFileError(ValueError):
    """A model file (config.json, a safetensors shard, an index) this loader cannot use.
    `path`: the file; `field`: the config field at fault, when one is."""

    def __init__(self, message: str, path: str | Path | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.field = field


class ModelConfigTypeError(ModelFileError, TypeError):
    """A config field holds the wrong JSON type (a string where a number belongs, ...)."""


def read_json_file(path: Path) -> Any:
    """The JSON in `path`; a file that is not JSON raises ModelFileError naming it, with line and column."""
    try:
        return json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        raise ModelFileError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                             path) from None
    except UnicodeDecodeError as exc:
        raise ModelFileError(f"{path}: not valid JSON: not UTF-8 text ({exc.reason} at byte {exc.start})",
                             path) from None


class _Strict(BaseModel):
    # strict: "64" is not an integer and 1e12 (a JSON float) is not one either; NaN/inf are no numbers
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True,
                              protected_namespaces=())   # config.json's `model_type` is a field


class RopeConfig(_Strict):
    """`rope_scaling` / `rope_parameters` (the keys the rotary embedding reads)."""

    model_config = ConfigDict(extra="allow")
    rope_type: str | None = None
    type: str | None = None   # the older key for rope_type
    rope_theta: float | None = Field(default=None, gt=0)
    factor: float | None = Field(default=None, gt=0)
    low_freq_factor: float | None = Field(default=None, gt=0)
    high_freq_factor: float | None = Field(default=None, gt=0)
    original_max_position_embeddings: int | None = Field(default=None, ge=1)
    short_factor: list[float] | None = None        # longrope: head_dim // 2 frequency divisors each
    long_factor: list[float] | None = None
    attention_factor: float | None = Field(default=None, gt=0)
    partial_rotary_factor: float | None = Field(default=None, gt=0)
    # transformers 5.x Gemma 3: one rope setting per layer type ({"full_attention": ..., "sliding_attention": ...})
    full_attention: RopeConfig | None = None
    sliding_attention: RopeConfig | None = None

    @property
    def kind(self) -> str:
        kind = self.rope_type or self.type or "default"
        return ROPE_TYPE_ALIASES.get(kind, kind)


class HFDecoderConfig(_Strict):
    """What `DecoderArch.from_hf_config` reads of a Llama-family config.json."""

    architectures: list[str] | None = None
    model_type: str = "llama"
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int | None = Field(default=None, ge=1)   # None: num_attention_heads
    head_dim: int | None = Field(default=None, ge=2)              # None: hidden_size // num_attention_heads
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float | None = Field(default=None, gt=0)
    rope_scaling: RopeConfig | None = None
    rope_parameters: RopeConfig | None = None
    max_position_embeddings: int = Field(default=2048, ge=1)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = Field(default=None, ge=0)   # 0 (Qwen2-MoE's saved configs): no window
    layer_types: list[str] | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = Field(default=None, ge=0)
    # mixture of experts (MOE_MODEL_TYPES): Mixtral names the expert count num_local_experts, Qwen num_experts
    num_local_experts: int | None = Field(default=None, ge=1)
    num_experts: int | None = Field(default=None, ge=1)
    num_experts_per_tok: int | None = None   # in [1, experts]: checked with the count (`_check_moe`)
    moe_intermediate_size: int | None = Field(default=None, ge=1)
    shared_expert_intermediate_size: int | None = Field(default=None, ge=0)   # 0 or null: no shared expert
    norm_topk_prob: bool = False
    decoder_sparse_step: int = Field(default=1, ge=1)
    mlp_only_layers: list[int] = []
    original_max_position_embeddings: int | None = Field(default=None, ge=1)   # Phi-3: longrope's, wins
    partial_rotary_factor: float | None = Field(default=None, gt=0)
    # Gemma 2 / 3 (read for GEMMA_MODEL_TYPES; None: transformers' default for the model type)
    hidden_activation: str | None = None
    hidden_act: str | None = None
    query_pre_attn_scalar: float | None = Field(default=None, gt=0)
    attn_logit_softcapping: float | None = Field(default=None, gt=0)
    final_logit_softcapping: float | None = Field(default=None, gt=0)
    rope_local_base_freq: float | None = Field(default=None, gt=0)
    sliding_window_pattern: int | None = Field(default=None, ge=1)
    use_bidirectional_attention: bool | None = None

    @property
    def rope_field(self) -> str | None:
        """Where the rotary settings are: "rope_parameters" (newer transformers) or "rope_scaling"."""
        for name in ("rope_parameters", "rope_scaling"):
            rope = getattr(self, name)
            if rope is not None and (rope.model_fields_set or rope.model_extra):   # {} counts as absent
                return name
        return None

    @property
    def rope(self) -> RopeConfig | None:
        return None if self.rope_field is None else getattr(self, self.rope_field)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_file_dict(cls, raw: Any, path: str | Path = "config.json") -> "HFDecoderConfig":
        """Validate the parsed config.json `raw`; errors name `path` and the field."""
        if not isinstance(raw, dict):
            raise ModelConfigTypeError(f"{path}: must hold a JSON object, got {type(raw).__name__}", path)
        try:
            cfg = cls.model_validate(raw)
        except ValidationError as exc:
            raise _field_error(exc, raw, path) from None
        cfg._check_together(path)
        return cfg

    def _check_together(self, path: str | Path) -> None:
        """Fields that must fit each other (the shapes the model is built with)."""
        def fail(field: str, message: str) -> None:
            raise ModelFileError(f"{path}: config field {field!r} {message}", path, field)

        heads, kv = self.num_attention_heads, self.num_key_value_heads or self.num_attention_heads
        if self.head_dim is None and self.hidden_size % heads:
            fail("num_attention_heads", f"must divide hidden_size ({self.hidden_size}) when head_dim is not set, "
                 f"got {heads}")
        if self.resolved_head_dim % 2:
            fail("head_dim", f"must be even (rotary embeddings rotate pairs), got {self.resolved_head_dim}"
                 + ("" if self.head_dim else f" (= hidden_size {self.hidden_size} // num_attention_heads {heads})"))
        if heads % kv:
            fail("num_key_value_heads", f"must divide num_attention_heads ({heads}), got {kv}")
        if self.model_type in MOE_MODEL_TYPES:
            self._check_moe(fail)
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                fail("layer_types", f"must have one entry per layer (num_hidden_layers = {self.num_hidden_layers}), "
                     f"got {len(self.layer_types)}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                fail("layer_types", f"entries must be one of {LAYER_TYPES}, got {bad[0]!r}")
        if self.model_type in GEMMA_MODEL_TYPES:
            self._check_gemma(path, fail)
        rope, name = self.rope, self.rope_field
        for where, partial in (("partial_rotary_factor", self.partial_rotary_factor),
                               (f"{name}.partial_rotary_factor", None if rope is None else rope.partial_rotary_factor)):
            if partial is not None and partial != 1.0:   # the rotary tables rotate all head_dim dimensions
                fail(where, f"must be 1.0 (partial rotary embeddings are not supported), got {partial}")
        if rope is None:
            return
        if rope.kind not in SUPPORTED_ROPE_TYPES:
            key = "rope_type" if rope.rope_type else "type"
            fail(f"{name}.{key}", f"must be one of {SUPPORTED_ROPE_TYPES}, got {rope.kind!r}")
        needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                    "original_max_position_embeddings")}.get(rope.kind, ())
        for key in needed:
            if getattr(rope, key) is None:
                fail(f"{name}.{key}", f"is missing (rope_type {rope.kind!r} needs {', '.join(needed)})")
        if rope.kind == "llama3" and rope.high_freq_factor <= rope.low_freq_factor:
            fail(f"{name}.high_freq_factor", f"must be greater than low_freq_factor ({rope.low_freq_factor}), "
                 f"got {rope.high_freq_factor}")
        if rope.kind == "longrope":
            self._check_longrope(rope, str(name), fail)

    def _check_longrope(self, rope: RopeConfig, name: str, fail: Callable[[str, str], None]) -> None:
        """longrope: both factor lists, head_dim // 2 numbers > 0 each, and the pretraining length
        (`original_max_position_embeddings`, top level or in the rope settings)."""
        half = self.resolved_head_dim // 2
        for key in ("short_factor", "long_factor"):
            factors = getattr(rope, key)
            if factors is None:
                fail(f"{name}.{key}", "is missing (rope_type 'longrope' needs short_factor and long_factor)")
            elif len(factors) != half:
                fail(f"{name}.{key}", f"must have head_dim // 2 = {half} entries, got {len(factors)}")
            elif min(factors) <= 0:
                fail(f"{name}.{key}", f"entries must be numbers > 0, got {min(factors)}")
        top = self.original_max_position_embeddings or ORIGINAL_MAX_DEFAULTS.get(self.model_type)
        own = rope.original_max_position_embeddings
        if top is None and own is None:
            fail("original_max_position_embeddings", f"is missing (rope_type 'longrope' needs it, at the top "
                 f"level or in {name})")
        if (top or own) == 1:   # ln(original) divides the attention factor
            fail("original_max_position_embeddings" if top else f"{name}.original_max_position_embeddings",
                 "must be an integer >= 2 for rope_type 'longrope', got 1")

    def _check_gemma(self, path: str | Path, fail: Callable[[str, str], None]) -> None:
        """Gemma 2 / 3: the MLP activation, causal attention, and each per-layer-type rope setting
        (checked like a top-level one, errors naming e.g. 'rope_parameters.full_attention.factor')."""
        for key in ("hidden_activation", "hidden_act"):
            act = getattr(self, key)
            if act is not None and act not in ACTIVATIONS:
                fail(key, f"must be one of {ACTIVATIONS}, got {act!r}")
        if self.use_bidirectional_attention:
            fail("use_bidirectional_attention", "must be false or null (only causal attention is supported), "
                 "got True")
        for kind in LAYER_TYPES:
            sub = None if self.rope_parameters is None else getattr(self.rope_parameters, kind)
            if sub is None:
                continue
            try:
                self.model_copy(update={"rope_parameters": sub, "rope_scaling": None})._check_together(path)
            except ModelFileError as exc:
                field = f"rope_parameters.{kind}." + str(exc.field).removeprefix("rope_parameters.")
                raise ModelFileError(str(exc).replace(repr(exc.field), repr(field)), path, field) from None

    @property
    def num_routed_experts(self) -> int | None:
        """The expert count of a mixture-of-experts config (num_experts, else num_local_experts)."""
        return self.num_experts if self.num_experts is not None else self.num_local_experts

    def _check_moe(self, fail: typing.Callable[[str, str], None]) -> None:
        """The mixture-of-experts fields of a model type in MOE_MODEL_TYPES."""
        experts, count_field = self.num_routed_experts, "num_local_experts" if self.model_type == "mixtral" \
            else "num_experts"
        if experts is None:
            fail(count_field, "is missing (a mixture-of-experts model needs its number of experts, an integer >= 1)")
            return
        k = self.num_experts_per_tok
        if k is None or not 1 <= k <= experts:
            fail("num_experts_per_tok", f"must be an integer in [1, {experts}] (1 to {count_field}), got {k!r}")
        if self.model_type != "mixtral" and self.moe_intermediate_size is None:
            fail("moe_intermediate_size", "is missing (the experts' intermediate size, an integer >= 1)")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            fail("mlp_only_layers", f"entries must be layer indices in [0, {self.num_hidden_layers - 1}], got {bad[0]}")


# ------------------------------------------------------------ error messages

_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object"}
_PLURALS = {int: "integers", float: "numbers", str: "strings"}


def _field_error(exc: ValidationError, raw: dict[str, Any], path: str | Path) -> ModelFileError:
    """The first failing field of `exc` as one message: file, field, allowed values, what was there."""
    err = exc.errors()[0]
    model: type[BaseModel] = HFDecoderConfig
    names: list[str] = []
    info: FieldInfo | None = None
    value: Any = raw
    for part in err["loc"]:   # walk the field path; union branch tags ('int', 'list[int]') end it
        if not (isinstance(part, str) and model is not None and part in model.model_fields):
            break
        info, names = model.model_fields[part], names + [part]
        value = value.get(part) if isinstance(value, dict) else None
        model = _submodel(info.annotation)
    field = ".".join(names) or str(err["loc"][0])
    wanted = _describe(info) if info is not None else err["msg"].lower()
    if err["type"] == "missing":
        return ModelFileError(f"{path}: config field {field!r} is missing (it must be {wanted})", path, field)
    cls = ModelConfigTypeError if err["type"].endswith("_type") else ModelFileError
    return cls(f"{path}: config field {field!r} must be {wanted}, got {value!r} ({type(value).__name__})",
               path, field)


def _describe(info: FieldInfo) -> str:
    """'an integer >= 1', 'a number > 0 or null', 'an integer, a list of integers or null', ..."""
    bound = "".join(f" >= {m.ge}" if isinstance(m, annotated_types.Ge) else f" > {m.gt}"
                    for m in info.metadata if isinstance(m, (annotated_types.Ge, annotated_types.Gt)))
    options = []
    nullable = False
    for arg in _union_args(info.annotation):
        if arg is type(None):
            nullable = True
        elif typing.get_origin(arg) is list:
            options.append(f"a list of {_PLURALS.get(typing.get_args(arg)[0], 'values')}")
        elif isinstance(arg, type) and issubclass(arg, BaseModel):
            options.append("an object")
        else:
            options.append(_KINDS.get(arg, str(arg)) + (bound if arg in (int, float) else ""))
    if nullable:
        options.append("null")
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


def _union_args(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _submodel(annotation: Any) -> type[BaseModel] | None:
    for arg in _union_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
