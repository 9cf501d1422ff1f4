"""Reading a PEFT LoRA adapter folder and checking it against a model (vLLM's rules and wording).

A folder saved by `peft` (`PeftModel.save_pretrained`) holds `adapter_config.json` and
`adapter_model.safetensors` with tensors named

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]
    base_model.model.model.embed_tokens.lora_embedding_A               [r, vocab]
    base_model.model.model.embed_tokens.lora_embedding_B               [hidden, r]
    base_model.model.lm_head.lora_A.weight / lora_B.weight             [r, hidden] / [vocab, r]

(`...embed_tokens.base_layer.weight` / `lm_head.base_layer.weight`, the frozen base matrices
peft saves next to an embedding adapter, are not read). A module's update is
`scaling * B @ A` with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`),
r and lora_alpha per module from `rank_pattern` / `alpha_pattern` as peft resolves them.
Only the tensors in the file say which modules are adapted (not `target_modules` or
`layers_to_transform`). Every refusal is a ValueError naming the folder and the module or field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from polyrunner.models.arch import DecoderArch
from polyrunner.models.hf_config import read_json_file

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
SUPPORTED_TARGETS = (*ATTENTION_TARGETS, *MLP_TARGETS, "embed_tokens", "lm_head")
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_MOE_PARTS = {"experts", "shared_expert", "shared_expert_gate", "block_sparse_moe"}   # module path parts
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$")
_LAYER = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<name>[A-Za-z0-9_]+)$")


@dataclass
class LoRAWeights:
    """One adapted module: its update is `b @ a` (float32, CPU)."""

    a: torch.Tensor   # [r, in] (embed_tokens: lora_embedding_A [r, vocab])
    b: torch.Tensor   # [out, r], multiplied by the module's scaling (embed_tokens: [hidden, r])

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class PeftAdapter:
    """A PEFT adapter as float32 CPU tensors, scaling folded into every `b`."""

    rank: int                                       # the largest rank over the modules
    modules: dict[tuple[int, str], LoRAWeights]     # (layer, HF module name), names in ATTENTION/MLP_TARGETS
    embed_tokens: LoRAWeights | None = None
    lm_head: LoRAWeights | None = None


class AdapterConfig(BaseModel):
    """The fields of `adapter_config.json` that change what the adapter computes."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)
    peft_type: str = "LORA"
    r: int = Field(ge=1)
    lora_alpha: float = Field(gt=0)
    use_rslora: bool = False
    rank_pattern: dict[str, int] | None = None
    alpha_pattern: dict[str, float] | None = None
    target_modules: list[str] | str | None = None   # informational: the file's tensors decide
    # refused when set (`_UNSUPPORTED`)
    modules_to_save: list[str] | None = None
    use_dora: bool = False
    bias: str = "none"
    lora_bias: bool = False
    fan_in_fan_out: bool = False
    target_parameters: list[str] | None = None
    trainable_token_indices: Any = None
    layer_replication: Any = None

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """`module`'s (r, lora_alpha): the first `rank_pattern` / `alpha_pattern` key matching the
        end of the module path on a dot boundary (peft's `get_pattern_key`), else `r` / `lora_alpha`."""
        r = _pattern_value(self.rank_pattern or {}, module)
        alpha = _pattern_value(self.alpha_pattern or {}, module)
        return (self.r if r is None else int(r)), (self.lora_alpha if alpha is None else float(alpha))

    def scaling(self, module: str) -> float:
        r, alpha = self.rank_and_alpha(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


# field -> (is it set?, what to say); vLLM's wording where vLLM has the check
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "modules_to_save": (lambda v: bool(v), "only modules_to_save being None is supported (as in vLLM)"),
    "use_dora": (lambda v: v, "DoRA is not supported (as in vLLM); it must be false"),
    "bias": (lambda v: v != "none", "adapter bias is not supported; it must be \"none\""),
    "lora_bias": (lambda v: v, "a bias on lora_B is not supported; it must be false"),
    "fan_in_fan_out": (lambda v: v, "it must be false (weights stored [out, in], as by torch.nn.Linear)"),
    "target_parameters": (lambda v: bool(v), "LoRA on parameters (a MoE layer's experts) is not supported; "
                                              "it must be null"),
    "trainable_token_indices": (lambda v: v is not None, "trainable tokens are not supported; it must be null"),
    "layer_replication": (lambda v: v is not None, "layer replication is not supported; it must be null"),
}


def _pattern_value(patterns: dict[str, Any], module: str) -> Any:
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as exc:
            raise ValueError(f"rank_pattern / alpha_pattern key {key!r} is not a regular expression: {exc}") from None
    return None


def read_config(path: Path) -> AdapterConfig:
    """`adapter_config.json` of the folder `path`, validated; errors name the file and the field."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"No adapter found for {path}: {CONFIG_FILE} is missing")
    raw = read_json_file(file)
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(raw).__name__}")
    try:
        cfg = AdapterConfig.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"][:1])
        raise ValueError(f"{file}: field {field!r}: {err['msg']}, got {raw.get(field)!r}") from None
    if cfg.peft_type != "LORA":
        raise ValueError(f"{file}: field 'peft_type' must be \"LORA\", got {cfg.peft_type!r}")
    for field, (is_set, why) in _UNSUPPORTED.items():
        value = getattr(cfg, field)
        if is_set(value):
            raise ValueError(f"{file}: field {field!r}: {why}, got {value!r}")
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        if (path / "adapter_model.bin").is_file():
            raise ValueError(f"{path}: adapter_model.bin is not supported; save the adapter with "
                             f"safe_serialization=True ({WEIGHTS_FILE})")
        raise ValueError(f"No adapter found for {path}: {WEIGHTS_FILE} is missing")
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{file}: not a readable safetensors file: {exc}") from None


def _module_of(key: str) -> tuple[str, str] | None:
    """(module path as peft names it, tensor kind) of a LoRA tensor name; None: a base-layer tensor
    saved next to an embedding adapter; anything else raises."""
    name = key.removeprefix(_PREFIX)
    m = _KEY.match(name)
    if m is not None:
        return m["module"], m["kind"]
    if name.endswith(("embed_tokens.base_layer.weight", "lm_head.base_layer.weight")):
        return None
    raise ValueError(f"unsupported tensor {key!r} (only lora_A / lora_B weights and lora_embedding_A / "
                     f"lora_embedding_B are read)")


def _target(module: str) -> tuple[int, str] | str | None:
    """(layer, name) of a decoder-layer module; "embed_tokens" / "lm_head"; None: not a target."""
    last = module.rsplit(".", 1)[-1]
    if last in ("embed_tokens", "lm_head") and module in (last, f"model.{last}"):
        return last
    m = _LAYER.match(module)
    if m is None:
        return None
    names = ATTENTION_TARGETS if m["block"] == "self_attn" else MLP_TARGETS
    return (int(m["layer"]), m["name"]) if m["name"] in names else None


def read_adapter(path: str | Path, max_lora_rank: int) -> PeftAdapter:
    """The PEFT adapter in folder `path` (module doc), every rank <= `max_lora_rank`. Raises
    ValueError for a missing folder or file, an `.bin` adapter, an unsupported config field
    (modules_to_save, use_dora, bias, ...), a module outside SUPPORTED_TARGETS or a MoE layer's
    experts, an A without its B, ranks that disagree, or a rank above max_lora_rank."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"No adapter found for {path}: not a folder")
    cfg = read_config(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(folder).items():
        try:
            parsed = _module_of(key)
        except ValueError as exc:
            raise ValueError(f"While loading {path}: {exc}") from None
        if parsed is None:
            continue
        module, kind = parsed
        if kind.startswith("lora_embedding_") != (_target(module) == "embed_tokens"):
            raise ValueError(f"While loading {path}: unsupported tensor {key!r} (embed_tokens has "
                             f"lora_embedding_A / lora_embedding_B, every other module lora_A / lora_B)")
        pairs.setdefault(module, {})[kind.split(".")[0].replace("lora_embedding_", "lora_")] = tensor

    experts = sorted(m for m in pairs if set(m.split(".")) & _MOE_PARTS)
    if experts:
        raise ValueError(f"While loading {path}: LoRA on a mixture-of-experts layer's experts is not supported "
                         f"(module {experts[0]})")
    unexpected = sorted(m for m in pairs if _target(m) is None)
    if unexpected:
        raise ValueError(f"While loading {path}, expected target modules in {list(SUPPORTED_TARGETS)} but received "
                         f"{unexpected}. Please verify that the loaded LoRA module is correct")

    adapter = PeftAdapter(rank=0, modules={})
    for module in sorted(pairs):
        weights = _weights(path, module, pairs[module], cfg, max_lora_rank)
        target = _target(module)
        if target == "embed_tokens":
            adapter.embed_tokens = weights
        elif target == "lm_head":
            adapter.lm_head = weights
        else:
            assert isinstance(target, tuple)
            if target in adapter.modules:
                raise ValueError(f"While loading {path}: layer {target[0]}'s {target[1]} appears twice ({module})")
            adapter.modules[target] = weights
        adapter.rank = max(adapter.rank, weights.rank)
    if adapter.rank == 0:
        raise ValueError(f"While loading {path}: {WEIGHTS_FILE} holds no LoRA weights")
    _check_fused_overlap(path, adapter)
    return adapter


def _weights(path: str | Path, module: str, pair: dict[str, torch.Tensor], cfg: AdapterConfig,
             max_lora_rank: int) -> LoRAWeights:
    where = f"While loading {path}: module {module}"
    missing = [k for k in ("lora_A", "lora_B") if k not in pair]
    if missing:
        raise ValueError(f"{where} has no {missing[0]} weight")
    a, b = pair["lora_A"], pair["lora_B"]
    if a.dim() != 2 or b.dim() != 2 or not a.is_floating_point() or not b.is_floating_point():
        raise ValueError(f"{where}: lora_A and lora_B must be 2-D floating-point tensors, got {a.dtype} "
                         f"{tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    rank = int(a.shape[0])
    if rank < 1 or b.shape[1] != rank:
        raise ValueError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} must share the rank "
                         f"(lora_A [r, in], lora_B [out, r], r >= 1)")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank} "
                         f"(module {module} of {path})")
    r, _ = cfg.rank_and_alpha(module)
    if r != rank:
        raise ValueError(f"{where}: {CONFIG_FILE} gives rank {r} (r / rank_pattern) but its tensors have rank "
                         f"{rank}")
    return LoRAWeights(a=a.to(torch.float32).contiguous(), b=b.to(torch.float32) * cfg.scaling(module))


def _check_fused_overlap(path: str | Path, adapter: PeftAdapter) -> None:
    for layer, name in adapter.modules:
        for part in FUSED.get(name, ()):
            if (layer, part) in adapter.modules:
                raise ValueError(f"While loading {path}: layer {layer} adapts both {name} and {part}, which "
                                 f"{name} contains")


def module_sizes(arch: DecoderArch) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear target module of the model `arch` describes (whole, unsharded)."""
    attn_q, attn_kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, inter = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, attn_q), "k_proj": (h, attn_kv), "v_proj": (h, attn_kv), "o_proj": (attn_q, h),
            "qkv_proj": (h, attn_q + 2 * attn_kv), "gate_proj": (h, inter), "up_proj": (h, inter),
            "gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}


def check_adapter(adapter: PeftAdapter, arch: DecoderArch) -> None:
    """Every module's shapes fit the model `arch` describes: a layer index < num_layers, lora_A
    [r, in], lora_B [out, r] with the module's sizes; no MLP module on a mixture-of-experts
    layer (its experts are not targets). Raises ValueError naming the module and the shape."""
    sizes, h = module_sizes(arch), arch.hidden_size
    for (layer, name), weights in sorted(adapter.modules.items()):
        where = f"LoRA module {name} of layer {layer}"
        if not 0 <= layer < arch.num_layers:
            raise ValueError(f"{where}: the layer index must be in [0, {arch.num_layers - 1}] "
                             f"(the model has {arch.num_layers} layers)")
        if name in MLP_TARGETS and arch.moe is not None and arch.moe.sparse_layers[layer]:
            raise ValueError(f"{where}: layer {layer}'s MLP is a mixture of experts; its experts are not "
                             f"LoRA targets")
        _check_shapes(where, weights, *sizes[name])
    if adapter.embed_tokens is not None:
        _check_shapes("LoRA module embed_tokens", adapter.embed_tokens, arch.vocab_size, h)
    if adapter.lm_head is not None:
        _check_shapes("LoRA module lm_head", adapter.lm_head, h, arch.vocab_size)


def _check_shapes(where: str, weights: LoRAWeights, fan_in: int, fan_out: int) -> None:
    r = weights.rank
    for which, tensor, expected in (("lora_A", weights.a, (r, fan_in)), ("lora_B", weights.b, (fan_out, r))):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{where}: {which} has shape {tuple(tensor.shape)}, the model needs {expected}")


def save_adapter(path: str | Path, modules: dict[tuple[int, str], LoRAWeights], rank: int, lora_alpha: float,
                 embed_tokens: LoRAWeights | None = None) -> None:
    """Write `modules` ((layer, module name) -> A [r, in] and B [out, r], B not scaled) and
    `embed_tokens` (A [r, vocab], B [hidden, r]) as a PEFT adapter folder that `read_adapter` (and
    peft) read: for tests and benchmarks that need adapters of a model's shapes without building
    the model."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    targets = sorted({name for _, name in modules} | ({"embed_tokens"} if embed_tokens is not None else set()))
    (folder / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": lora_alpha,
                                                  "target_modules": targets, "bias": "none"}))
    tensors = {}
    for (layer, name), w in modules.items():
        block = "self_attn" if name in ATTENTION_TARGETS else "mlp"
        key = f"{_PREFIX}model.layers.{layer}.{block}.{name}"
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = w.a.contiguous(), w.b.contiguous()
    if embed_tokens is not None:
        key = f"{_PREFIX}model.embed_tokens"
        tensors[f"{key}.lora_embedding_A"] = embed_tokens.a.contiguous()
        tensors[f"{key}.lora_embedding_B"] = embed_tokens.b.contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE))

