"""The "lora" role: a linear plus the low-rank updates of the adapters in a step, per token.

Adapters live in `max_loras` device slots, stacked and zero-padded so every
shape is fixed (graph capture, static-shape backends):

- `lora_a [L, S * R, in]`: slot l's A matrices, sub-projection s in rows `s*R : s*R + r_s`;
- `lora_b [L, out, S * R]`: slot l's B matrices, already multiplied by the adapter's scaling;
  block diagonal: the rows of output slice s read only columns `s*R : (s+1)*R`;
- `token_lora [T]` int32: each token's slot, -1 for a token without an adapter.

`R` is `max_lora_rank`, `S` the number of sub-projections fused in the linear
(`output_slices`: 3 for qkv, 2 for gate_up, else 1). A token of slot l gets
`(x @ lora_a[l].T) @ lora_b[l].T` added to the base output; a token with -1 gets
nothing. An empty slot is all zeros.

The "lora_embedding" role is the same for the token embeddings (peft's `embed_tokens`
adapters): `lora_a [L, V, R]` (peft's lora_embedding_A, transposed), `lora_b [L, H, R]`
(scaled); a token `id` of slot l gets `lora_a[l, id] @ lora_b[l].T` added to its embedding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_lora: torch.Tensor) -> torch.Tensor:
    """`y [T, out]` plus each token's adapter update (module doc), computed in float32 and
    returned in y's dtype. The reference: a loop over the slots, each applied to every token and
    masked, so the shapes never depend on the step (graph-safe; a device override groups tokens
    by slot instead and skips the others)."""
    acc = y.float()
    xf = x.float()
    for slot in range(lora_a.shape[0]):
        delta = (xf @ lora_a[slot].float().t()) @ lora_b[slot].float().t()
        acc = acc + delta * (token_lora == slot).unsqueeze(-1)
    return acc.to(y.dtype)


def add_lora_embedding(y: torch.Tensor, input_ids: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       token_lora: torch.Tensor) -> torch.Tensor:
    """`y [T, H]` (the tokens' embeddings) plus each token's embedding update (module doc), in
    float32, returned in y's dtype. Static shapes (graph-safe): each token's row of A in its
    slot's block of `[T, L * R]` (zeros elsewhere and for -1), times every slot's B at once."""
    slots, vocab, rank = lora_a.shape
    slot = token_lora.long()
    has = ((slot >= 0) & (slot < slots)).unsqueeze(-1)   # a slot outside [0, L): no adapter, as add_lora
    slot = slot.clamp(0, slots - 1)
    index = slot * vocab + input_ids.long().clamp(0, vocab - 1)
    rows = lora_a.reshape(slots * vocab, rank)[index].float() * has            # [T, R]
    onehot = (slot.unsqueeze(-1) == torch.arange(slots, device=slot.device)).float() * has   # [T, L] (no sync)
    wide = (onehot.unsqueeze(-1) * rows.unsqueeze(1)).reshape(-1, slots * rank)
    stacked = lora_b.float().permute(0, 2, 1).reshape(slots * rank, -1)        # [L * R, H]
    return (y.float() + wide @ stacked).to(y.dtype)


class LoRAMapping:
    """The step's `token_lora` for every LoRA linear of a model: one persistent int32
    buffer of `max_tokens` entries on the device (a graph input: written in place before
    each step, never reallocated); a linear called with T rows reads `token_lora[:T]`.
    `logits_lora`: the same for the rows whose logits are computed (the LM head's adapters).

    `upload`: for a backend that compiles each step with its inputs as arguments (static shapes)
    rather than replaying captured graphs over fixed buffers: each `set` then replaces the
    buffer by `upload(whole new buffer)` (a fresh device array of the same shape) instead of
    writing it in place."""

    def __init__(self, max_tokens: int, device: torch.device | str = "cpu",
                 upload: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.upload = upload
        self.token_lora = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.logits_lora = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)

    def set(self, token_lora: torch.Tensor) -> None:
        """This step's slots (`[T]`, T <= max_tokens); the rest of the buffer becomes -1."""
        self.token_lora = self._write(self.token_lora, token_lora)

    def set_logits(self, rows: torch.Tensor) -> None:
        """The slots of the next logits rows (`[N]`); the rest become -1."""
        self.logits_lora = self._write(self.logits_lora, rows)

    def _write(self, buffer: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        n = int(values.shape[0])
        if n > buffer.shape[0]:
            raise ValueError(f"a step of {n} rows exceeds the LoRA mapping's {buffer.shape[0]}")
        if self.upload is not None:
            whole = torch.full(tuple(buffer.shape), -1, dtype=torch.int32)
            whole[:n] = values
            return self.upload(whole)
        buffer[:n].copy_(values, non_blocking=True)
        buffer[n:].fill_(-1)
        return buffer


def slot_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """Zeroed adapter slots (`shape[0]` = max_loras), written when adapters are loaded; no grad."""
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


# the "lora" role's attributes a replacement keeps (the same objects: base module, parameters, mapping)
ROLE_ATTRIBUTES = ("base", "in_features", "output_slices", "max_rank", "mapping", "lora_a", "lora_b")


def keep_lora_attributes(dst: nn.Module, src: nn.Module) -> None:
    """Give an override `dst` the role attributes of the LoRA linear `src` it replaces."""
    for name in ROLE_ATTRIBUTES:
        setattr(dst, name, getattr(src, name))


class LoRALinear(nn.Module):
    """`base` (any module with a linear's call) plus the adapters in the slots.

    `forward(x [T, in]) -> [T, out] = add_lora(base(x), x, lora_a, lora_b, mapping.token_lora[:T])`.
    Attributes a replacement keeps: `base`, `lora_a`, `lora_b`, `output_slices`, `max_rank` and
    `mapping`. Adapters are written into `lora_a` / `lora_b` in place when they are loaded, so a
    replacement reads them at call time (it may not pack or copy them once)."""

    def __init__(self, base: nn.Module, in_features: int, output_slices: tuple[int, ...], max_loras: int,
                 max_rank: int, mapping: LoRAMapping, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.output_slices = output_slices
        self.max_rank = max_rank
        self.mapping = mapping
        ranks, out = len(output_slices) * max_rank, sum(output_slices)
        self.lora_a = slot_parameter((max_loras, ranks, in_features), dtype, device)
        self.lora_b = slot_parameter((max_loras, out, ranks), dtype, device)

    @property
    def max_loras(self) -> int:
        return int(self.lora_a.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return add_lora(y, x, self.lora_a, self.lora_b, self.mapping.token_lora[: x.shape[0]])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, output_slices={self.output_slices}, max_loras={self.max_loras}, " \
               f"max_rank={self.max_rank}"


class LoRAEmbedding(nn.Module):
    """The embeddings' adapters in `max_loras` slots: `forward(input_ids [T], x [T, H]) -> [T, H] =
    add_lora_embedding(x, input_ids, lora_a, lora_b, mapping.token_lora[:T])`. Attributes a
    replacement keeps (and reads at call time): `lora_a [L, V, R]`, `lora_b [L, H, R]`, `mapping`.
    Runs inside the captured decode graphs, for every token (an empty slot is zeros)."""

    def __init__(self, vocab: int, hidden: int, max_loras: int, max_rank: int, mapping: LoRAMapping,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.mapping = mapping
        self.lora_a = slot_parameter((max_loras, vocab, max_rank), dtype, device)
        self.lora_b = slot_parameter((max_loras, hidden, max_rank), dtype, device)

    def forward(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return add_lora_embedding(x, input_ids, self.lora_a, self.lora_b, self.mapping.token_lora[: x.shape[0]])

    def extra_repr(self) -> str:
        slots, vocab, rank = self.lora_a.shape
        return f"vocab={vocab}, hidden={self.lora_b.shape[1]}, max_loras={slots}, max_rank={rank}"


EMBEDDING_ATTRIBUTES = ("lora_a", "lora_b", "mapping")   # what a "lora_embedding" replacement keeps


def lora_places(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """`(role, parent, attribute, module)` for each `LoRALinear` ("lora") and `LoRAEmbedding`
    ("lora_embedding") in `model`: a model's `replaceable_modules` entries for the LoRA roles (none
    unless LoRA is enabled)."""
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, LoRALinear):
                yield "lora", parent, attr, child
            elif isinstance(child, LoRAEmbedding):
                yield "lora_embedding", parent, attr, child
