"""The Gemma 2 and Gemma 3 (text) family: the decoder of `decoder.py` with what Gemma changes.

- embeddings times sqrt(hidden_size) (the normaliser cast to the hidden dtype, as transformers);
- `GemmaRMSNorm` ((1 + weight), float32 then cast) everywhere, four per layer: input,
  post-attention (on the attention output, before the residual add), pre- and
  post-feed-forward; Gemma 3 also on q and k per head. Not offered as "rms_norm"
  (that role's contract is Llama's norm);
- a GeGLU MLP (`arch.hidden_act`, tanh-approximated GELU): its linears are replaceable,
  the MLP is not a "gated_mlp" (whose replacements compute SiLU);
- attention scale `query_pre_attn_scalar ** -0.5`, attention logit soft-capping
  (`LayerSpec.logits_soft_cap`, Gemma 2) and final logit soft-capping in `compute_logits`;
- per-layer sliding windows (`arch.sliding_windows`) and, for Gemma 3, a second rotary
  table (the local rope base) for the sliding-window layers.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
from torch import nn

from polyrunner.distributed.shard import TPShard
from polyrunner.models.arch import DecoderArch
from polyrunner.models.decoder import (
    AllReduce,
    AttentionOp,
    DecoderAttention,
    DecoderForCausalLM,
    DecoderLayer,
)
from polyrunner.models.gemma_norm import GemmaRMSNorm
from polyrunner.ops import GatedMLP, RotaryEmbedding
from polyrunner.ops.lora import lora_places

GEMMA_FAMILY = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

Replaceable = Iterator[tuple[str, nn.Module, str, nn.Module]]


class GemmaAttention(DecoderAttention):
    """`DecoderAttention` with Gemma's scale, soft cap and q/k norms."""

    def __init__(self, arch: DecoderArch, layer_idx: int, attn_op: AttentionOp,
                 rotary: RotaryEmbedding, shard: TPShard | None = None) -> None:
        super().__init__(arch, layer_idx, attn_op, rotary, shard)
        if arch.qk_norm:
            # Gemma norms in the places of the decoder's (same calls: forward, forward_add)
            self.q_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps)   # type: ignore[assignment]
            self.k_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps)   # type: ignore[assignment]
        scalar = arch.query_pre_attn_scalar or self.head_dim
        self.spec = dataclasses.replace(self.spec, scale=scalar ** -0.5,
                                        logits_soft_cap=arch.attn_logit_softcapping)


class GemmaLayer(DecoderLayer):
    """Sandwich norms around attention and MLP; returns `(mlp_out, residual)` like `DecoderLayer`."""

    attention_cls = GemmaAttention

    def __init__(self, arch: DecoderArch, layer_idx: int, attn_op: AttentionOp,
                 rotary: RotaryEmbedding, shard: TPShard | None = None, all_reduce: AllReduce | None = None
                 ) -> None:
        super().__init__(arch, layer_idx, attn_op, rotary, shard, all_reduce)
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)            # type: ignore[assignment]
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)   # type: ignore[assignment]
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def make_mlp(self, arch: DecoderArch, layer_idx: int, shard: TPShard) -> nn.Module:
        return GatedMLP(arch.hidden_size, shard.intermediate, arch.mlp_bias, activation=arch.hidden_act)

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma's sandwich: the post-attention norm before the residual add, the pre-feed-forward
        norm fused with it, the MLP summed over the ranks, then the post-feed-forward norm."""
        h = self.post_attention_layernorm(h)
        h, residual = self.pre_feedforward_layernorm.forward_add(h, residual)
        h = self.mlp(h)
        if self.all_reduce is not None:
            h = self.all_reduce(h)
        return self.post_feedforward_layernorm(h), residual

    def replaceable(self) -> Replaceable:
        """The linears, the rotary module and (SiLU only) the MLP; no norms."""
        attn = self.self_attn
        yield "linear", attn, "qkv_proj", attn.qkv_proj
        yield "rotary", attn, "rotary", attn.rotary
        yield "linear", attn, "o_proj", attn.o_proj
        yield from self.mlp_replaceable()


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma 2 / Gemma 3 text; see the module docstring for what differs from `DecoderForCausalLM`."""

    layer_cls = GemmaLayer

    def __init__(self, arch: DecoderArch, attn_op: AttentionOp, max_positions: int,
                 shard: TPShard | None = None, all_reduce: AllReduce | None = None) -> None:
        super().__init__(arch, attn_op, max_positions, shard, all_reduce)
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)   # type: ignore[assignment]
        theta, scaling = arch.sliding_rope_theta, arch.sliding_rope_scaling
        self.rotary_local: RotaryEmbedding | None = None
        if theta is not None and (theta, scaling) != (arch.rope_theta, arch.rope_scaling):
            self.rotary_local = RotaryEmbedding(arch.head_dim, max_positions, theta, scaling)
            for layer, window in zip(self.gemma_layers(), arch.sliding_windows):
                if window is not None:
                    layer.self_attn.rotary = self.rotary_local

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        if self.arch.embed_scale is None:
            return x
        return x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`DecoderForCausalLM.compute_logits`, then `cap * tanh(logits / cap)` (final_logit_softcapping)."""
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def replaceable_modules(self) -> Replaceable:
        """The rotary modules and each layer's `GemmaLayer.replaceable`; the Gemma norms are not offered."""
        yield "rotary", self, "rotary", self.rotary
        if self.rotary_local is not None:
            yield "rotary", self, "rotary_local", self.rotary_local
        for layer in self.gemma_layers():
            yield from layer.replaceable()
        yield from lora_places(self)

    def gemma_layers(self) -> list[GemmaLayer]:
        return [layer for layer in self.layers if isinstance(layer, GemmaLayer)]
