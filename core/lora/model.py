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

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from polyrunner.config import LoRAConfig
from polyrunner.distributed.shard import TPShard
from polyrunner.lora.peft import LoRAWeights, PeftAdapter, module_sizes
from polyrunner.lora.vocab import LoRALogits
from polyrunner.models.arch import DecoderArch
from polyrunner.ops.lora import LoRAEmbedding, LoRALinear, LoRAMapping

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


def _parts(adapter: PeftAdapter, layer: int, name: str, arch: DecoderArch) -> list[LoRAWeights | None]:
    """The adapter's weights for each output slice of wrapped linear `name` (None: not targeted);
    a fused checkpoint module is split into its slices."""
    fused = adapter.modules.get((layer, name))
    if fused is None or name not in ("qkv_proj", "gate_up_proj"):
        return [adapter.modules.get((layer, part)) for part in SLICES[name]]
    sizes = [module_sizes(arch)[part][1] for part in SLICES[name]]
    return [LoRAWeights(fused.a, b) for b in torch.split(fused.b, sizes, dim=0)]


Upload = Callable[[torch.Tensor], torch.Tensor]   # host tensor -> a fresh device array (static-shape backends)


def store(param: torch.Tensor, slot: int, values: torch.Tensor, upload: Upload | None) -> None:
    """`param[slot] = values` (built on the host): in place, or with `upload` by replacing the
    parameter's data with a fresh device array (a backend that compiles steps with the weights as
    arguments must not see lazy in-place writes)."""
    with torch.no_grad():
        if upload is None:
            param[slot].copy_(values)
            return
        whole = param.detach().cpu()
        whole[slot] = values
        param.data = upload(whole)


def write_slot(targets: list[LoRATarget], slot: int, adapter: PeftAdapter | None, arch: DecoderArch,
               shard: TPShard, upload: Upload | None = None) -> None:
    """Fill slot `slot` of every target with `adapter` (this rank's shard; None: empty it)."""
    for t in targets:
        a_slot = torch.zeros(t.lora_a.shape[1:], dtype=t.lora_a.dtype)
        b_slot = torch.zeros(t.lora_b.shape[1:], dtype=t.lora_b.dtype)
        if adapter is not None:
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
                    a_slot[s * R:s * R + r] = a
                    b_slot[offset:offset + size, s * R:s * R + r] = b
                offset += size
        store(t.lora_a, slot, a_slot, upload)
        store(t.lora_b, slot, b_slot, upload)


def write_lm_head(head: LoRALogits, slot: int, weights: LoRAWeights | None, shard: TPShard,
                  upload: Upload | None = None) -> None:
    """Fill slot `slot` of the LM head's adapters (this rank's vocabulary rows of B; None: empty it)
    and keep `head.slots` (the slots it runs) in step."""
    a_slot = torch.zeros(head.a.shape[1:], dtype=head.a.dtype)
    b_slot = torch.zeros(head.b.shape[1:], dtype=head.b.dtype)
    if weights is not None:
        r = weights.a.shape[0]
        a_slot[:r] = weights.a
        b_slot[:, :r] = shard.slice("lm_head.weight", weights.b)
    store(head.a, slot, a_slot, upload)
    store(head.b, slot, b_slot, upload)
    head.slots = sorted(set(head.slots) - {slot} | ({slot} if weights is not None else set()))


def write_embedding(emb: LoRAEmbedding, slot: int, weights: LoRAWeights | None, upload: Upload | None = None) -> None:
    """Fill slot `slot` of the embeddings' adapters with peft's `embed_tokens` weights (A [r, vocab]
    stored transposed, B [hidden, r] scaled; the whole vocabulary on every rank: the update is
    added after the embedding's all-reduce); None: empty it."""
    a_slot = torch.zeros(emb.lora_a.shape[1:], dtype=emb.lora_a.dtype)
    b_slot = torch.zeros(emb.lora_b.shape[1:], dtype=emb.lora_b.dtype)
    if weights is not None:
        r = weights.a.shape[0]
        a_slot[:, :r] = weights.a.t()
        b_slot[:, :r] = weights.b
    store(emb.lora_a, slot, a_slot, upload)
    store(emb.lora_b, slot, b_slot, upload)
