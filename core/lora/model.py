"""A model's LoRA targets: its linears wrapped in `LoRALinear`, and adapters written into slots.

Every decoder layer's `qkv_proj`, `o_proj` and (a dense MLP's) `gate_up_proj` and `down_proj`
are wrapped, after the backend's other overrides, so the base stays the backend's fastest
linear. A fused linear has one output slice per checkpoint module (`SLICES`); an adapter that
stores the fused module itself (Phi-3's `qkv_proj`) has its B split into those slices, each
with the same A.

With tensor parallelism each rank holds its shard, cut like the base weight: column-parallel
linears (qkv, gate_up) take B's rows of their output, row-parallel ones (o, down) A's columns of
their input, so the partial outputs sum in the layer's all-reduce as the base outputs do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from polyrunner.config import LoRAConfig
from polyrunner.distributed.shard import TPShard
from polyrunner.lora.peft import LoRAWeights, PeftAdapter
from polyrunner.lora.vocab import LoRALogits
from polyrunner.models.arch import DecoderArch
from polyrunner.ops.lora import LoRALinear, LoRAMapping

# wrapped linear -> the checkpoint modules of its output slices, in order
SLICES: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                                      "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})   # input split across ranks: A is cut, B whole


@dataclass
class LoRATarget:
    """One wrapped linear: where it sits and its stacked slots (the parameters any override keeps)."""

    layer: int
    name: str                  # a key of SLICES
    parent: nn.Module
    lora_a: torch.Tensor       # [L, S * R, in]
    lora_b: torch.Tensor       # [L, out, S * R]
    output_slices: tuple[int, ...]
    max_rank: int


def _places(model: nn.Module, hidden: int) -> Iterator[tuple[int, str, nn.Module, int, tuple[int, ...]]]:
    """(layer, name, parent, fan in, this rank's output slices) of every linear LoRA can wrap."""
    for i, layer in enumerate(getattr(model, "layers", ())):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = int(attn.q_size), int(attn.kv_size)
        yield i, "qkv_proj", attn, hidden, (q, kv, kv)
        yield i, "o_proj", attn, q, (hidden,)
        if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):   # a dense MLP (not MoE experts)
            inter = int(mlp.intermediate)
            yield i, "gate_up_proj", mlp, hidden, (inter, inter)
            yield i, "down_proj", mlp, inter, (hidden,)


def wrap_linears(model: nn.Module, arch: DecoderArch, config: LoRAConfig, mapping: LoRAMapping, dtype: torch.dtype,
                 device: torch.device | str) -> list[LoRATarget]:
    """Wrap every target linear of `model` (a decoder of `arch`) in a `LoRALinear` with empty slots."""
    targets = []
    for layer, name, parent, fan_in, slices in _places(model, arch.hidden_size):
        linear = getattr(parent, name)
        wrapped = LoRALinear(linear, fan_in, slices, config.max_loras, config.max_lora_rank, mapping, dtype, device)
        setattr(parent, name, wrapped)
        targets.append(LoRATarget(layer, name, parent, wrapped.lora_a, wrapped.lora_b, slices, config.max_lora_rank))
    return targets


def target_modules(arch: DecoderArch) -> dict[str, tuple[int, int]]:
    """Checkpoint module -> (out, in) of its whole (unsharded) weight: the shapes an adapter's
    B and A must fit."""
    h, q, kv, inter = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
            "up_proj": (inter, h), "down_proj": (h, inter), "qkv_proj": (q + 2 * kv, h),
            "gate_up_proj": (2 * inter, h)}


def _parts(adapter: PeftAdapter, layer: int, name: str, arch: DecoderArch) -> list[LoRAWeights | None]:
    """The adapter's weights for each output slice of wrapped linear `name` (None: not targeted);
    a fused checkpoint module is split into its slices."""
    fused = adapter.modules.get((layer, name))
    if fused is None or name not in ("qkv_proj", "gate_up_proj"):
        return [adapter.modules.get((layer, part)) for part in SLICES[name]]
    sizes = [target_modules(arch)[part][0] for part in SLICES[name]]
    return [LoRAWeights(fused.a, b) for b in torch.split(fused.b, sizes, dim=0)]


def write_slot(targets: list[LoRATarget], slot: int, adapter: PeftAdapter | None, arch: DecoderArch,
               shard: TPShard) -> None:
    """Fill slot `slot` of every target with `adapter` (this rank's shard; None: empty it)."""
    with torch.no_grad():
        for t in targets:
            t.lora_a[slot].zero_()
            t.lora_b[slot].zero_()
            if adapter is None:
                continue
            offset, R = 0, t.max_rank
            for s, (part, w) in enumerate(zip(SLICES[t.name], _parts(adapter, t.layer, t.name, arch))):
                size = t.output_slices[s]
                if w is not None:
                    a, b = w.a, w.b
                    if t.name in ROW_PARALLEL:
                        a = shard.slice(f"{part}.weight", a)
                    else:
                        b = shard.slice(f"{part}.weight", b)
                    r = a.shape[0]
                    t.lora_a[slot, s * R:s * R + r].copy_(a)
                    t.lora_b[slot, offset:offset + size, s * R:s * R + r].copy_(b)
                offset += size


def write_lm_head(head: LoRALogits, slot: int, weights: LoRAWeights | None, shard: TPShard) -> None:
    """Fill slot `slot` of the LM head's adapters (this rank's vocabulary rows of B; None: empty it)
    and keep `head.slots` (the slots it runs) in step."""
    with torch.no_grad():
        head.a[slot].zero_()
        head.b[slot].zero_()
        if weights is not None:
            r = weights.a.shape[0]
            head.a[slot, :r].copy_(weights.a)
            head.b[slot, :, :r].copy_(shard.slice("lm_head.weight", weights.b))
    head.slots = sorted(set(head.slots) - {slot} | ({slot} if weights is not None else set()))

