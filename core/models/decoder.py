"""The decoder pieces every model family shares: attention, the layer, the model.

A family is a subclass that changes what differs through hooks (`DecoderLayer.make_mlp`,
`DecoderLayer.replaceable`, `DecoderLayer.attention_cls`, `DecoderForCausalLM.layer_cls`, the weight-loading hooks
`weight_target` / `weight_parts` / `part_view`) rather than a copy of this file;
`llama.py` is the plain decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM).

One implementation over the paged-attention interface: the attention op is
the backend's, called with the step's `AttentionMetadata` and the layer's KV
cache. Projections are fused (qkv, gate_up) column-parallel layers followed by
row-parallel ones (o_proj, down_proj). With tensor parallelism (`tp`) each rank
builds and loads only its shard (`distributed.shard.TPShard`) and sums the
row-parallel outputs and the vocabulary-parallel embedding with an all-reduce
in `DecoderLayer` / the model (not inside a module a backend may replace).
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.distributed.shard import TPShard
from polyrunner.models.arch import DecoderArch
from polyrunner.ops import GatedMLP, RMSNorm, RotaryEmbedding
from polyrunner.ops.lora import lora_places

AttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        AttentionMetadata, LayerSpec], torch.Tensor]
AllReduce = Callable[[torch.Tensor], torch.Tensor]   # sums a tensor over the tensor-parallel ranks


class DecoderAttention(nn.Module):
    def __init__(self, arch: DecoderArch, layer_idx: int, attn_op: AttentionOp,
                 rotary: RotaryEmbedding, shard: TPShard | None = None) -> None:
        super().__init__()
        shard = shard or TPShard.single(arch)
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = rotary
        self.attn_op = attn_op
        self.layer_idx = layer_idx
        self.spec = LayerSpec(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5, arch.sliding_windows[layer_idx])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn_op(q, k, v, kv_cache, meta, self.spec)
        return self.o_proj(out.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    attention_cls: type[DecoderAttention] = DecoderAttention   # a family's attention (same constructor)

    def __init__(self, arch: DecoderArch, layer_idx: int, attn_op: AttentionOp,
                 rotary: RotaryEmbedding, shard: TPShard | None = None, all_reduce: AllReduce | None = None
                 ) -> None:
        super().__init__()
        shard = shard or TPShard.single(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self.attention_cls(arch, layer_idx, attn_op, rotary, shard)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = self.make_mlp(arch, layer_idx, shard)
        self.all_reduce = all_reduce

    def make_mlp(self, arch: DecoderArch, layer_idx: int, shard: TPShard) -> nn.Module:
        """The feed-forward block of layer `layer_idx` (this rank's shard): Llama's gated MLP."""
        return GatedMLP(arch.hidden_size, shard.intermediate, arch.mlp_bias)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(mlp_out, residual)`: the layer's output is their sum, which the
        next layer's (or the final) norm forms with `forward_add` (vLLM's scheme:
        each residual add is fused with the norm that follows it)."""
        h, residual = self.attend(positions, x, meta, kv_cache, residual)
        return self.feed_forward(h, residual)

    def attend(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
               kv_cache: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm (fused with the residual add) and attention, summed over the ranks:
        `(attention_out, residual)`."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h = self.self_attn(positions, h, meta, kv_cache)
        return (h if self.all_reduce is None else self.all_reduce(h)), residual

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm (fused with the residual add) and the MLP, summed over the
        ranks: `(mlp_out, residual)`."""
        h, residual = self.post_attention_layernorm.forward_add(h, residual)
        h = self.mlp(h)
        return (h if self.all_reduce is None else self.all_reduce(h)), residual

    def replaceable(self) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
        """This layer's part of `DecoderForCausalLM.replaceable_modules`, in order."""
        attn = self.self_attn
        yield "rms_norm", self, "input_layernorm", self.input_layernorm
        yield "linear", attn, "qkv_proj", attn.qkv_proj
        for name in ("q_norm", "k_norm"):
            if getattr(attn, name) is not None:
                yield "rms_norm", attn, name, getattr(attn, name)
        yield "rotary", attn, "rotary", attn.rotary
        yield "linear", attn, "o_proj", attn.o_proj
        yield "rms_norm", self, "post_attention_layernorm", self.post_attention_layernorm
        yield from self.mlp_replaceable()

    def mlp_replaceable(self) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
        """The feed-forward block's replaceable parts (`make_mlp`'s module): a gated MLP's."""
        mlp = self.mlp
        yield "linear", mlp, "gate_up_proj", mlp.gate_up_proj
        yield "linear", mlp, "down_proj", mlp.down_proj
        if getattr(mlp, "activation", "silu") == "silu":   # the role's replacements compute SiLU
            yield "gated_mlp", self, "mlp", mlp


class DecoderForCausalLM(nn.Module):
    """Token ids + positions + attention metadata + KV caches -> hidden states.

    `shard` / `all_reduce`: this rank's part of a tensor-parallel model and the sum
    over ranks (None: the whole model). `compute_logits` then gives this rank's
    vocabulary range; the runner's caller gathers the ranges."""

    layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, arch: DecoderArch, attn_op: AttentionOp, max_positions: int,
                 shard: TPShard | None = None, all_reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.shard = shard = shard or TPShard.single(arch)
        self.all_reduce = all_reduce
        vocab = shard.vocab_per_rank
        # `_weight` skips the random init (which, on the meta device, would import torch._dynamo)
        self.embed_tokens = nn.Embedding(vocab, arch.hidden_size, _weight=torch.empty(vocab, arch.hidden_size))
        rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.rotary = rotary
        self.layers = nn.ModuleList(self.layer_cls(arch, i, attn_op, rotary, shard, all_reduce)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, vocab, bias=False)
        # LoRA adapters on the embedding / LM head (polyrunner.lora.vocab), set when LoRA is enabled
        self.embed_lora: nn.Module | None = None
        self.lm_head_lora: nn.Module | None = None
        # the LM head as a backend's quantized module (`Backend.quantize_model`): `compute_logits` calls it
        self.quantized_lm_head: nn.Module | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; vocabulary-parallel: each rank looks up its own range
        (zeros elsewhere) and the all-reduce sums them. Adapters' updates are added last."""
        if self.all_reduce is None:
            x = self.embed_tokens(input_ids)
        else:
            local = input_ids - self.shard.vocab_start
            outside = (local < 0) | (local >= self.shard.vocab_per_rank)
            x = self.all_reduce(self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0))
        return x if self.embed_lora is None else self.embed_lora(input_ids, x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, meta, kv_cache, residual)
        return self.norm(x) if residual is None else self.norm.forward_add(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits `[N, vocab]` for the given hidden rows (tensor-parallel:
        `[N, shard.vocab_per_rank]`, this rank's range)."""
        head = self.quantized_lm_head
        logits = (F.linear(hidden, self._dense_head()) if head is None else head(hidden)).float()
        return logits if self.lm_head_lora is None else self.lm_head_lora(hidden, logits)

    def lm_head_weight(self) -> torch.Tensor | None:
        """The `[vocab, hidden]` matrix of `compute_logits` (the embedding when tied); None when
        a backend's `quantized_lm_head` computes the logits instead (no dense matrix is kept)."""
        return self._dense_head() if self.quantized_lm_head is None else None

    def _dense_head(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def replaceable_modules(self) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
        """`(role, parent, attribute, module)` for every part a backend may swap for
        a faster equivalent (`setattr(parent, attribute, new)`); the roles and
        what a replacement must keep are in `polyrunner.ops.ROLES`
        (core/ops/roles.py). Attributes are read as the iteration goes,
        so a later pass sees an earlier pass's replacements. The LM head (read by
        `compute_logits`) is not a "linear"; the shared rotary module comes once
        per parent (this model and each attention)."""
        yield "rotary", self, "rotary", self.rotary
        for layer in self.layers:
            yield from layer.replaceable()
        yield "rms_norm", self, "norm", self.norm
        yield from lora_places(self)

    # ---- weights ---------------------------------------------------------
    # vLLM's name: fused module -> the checkpoint modules whose rows it stacks, in order
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    _STACKED = {  # HF name part -> (fused param part, shard index)
        part: (fused, i) for fused, parts in packed_modules_mapping.items() for i, part in enumerate(parts)}

    def weight_target(self, hf_name: str) -> tuple[str, Hashable] | None:
        """The parameter a checkpoint tensor fills and which part of it (None: the whole
        parameter; a fused module's index in `packed_modules_mapping`); None skips the tensor."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (self.lm_head is None and name.startswith("lm_head")):
            return None
        for part, (fused, idx) in self._STACKED.items():
            if f".{part}." in name:
                return name.replace(part, fused), idx
        return name, None

    def weight_parts(self, param_name: str) -> tuple[Hashable, ...]:
        """Every part `weight_target` must deliver for the parameter (each exactly once)."""
        fused = param_name.split(".")[-2] if "." in param_name else ""
        return tuple(range(len(self.packed_modules_mapping[fused]))) if fused in self.packed_modules_mapping \
            else (None,)

    def part_view(self, param_name: str, param: torch.Tensor, part: Hashable) -> torch.Tensor:
        """The view of `param` that `part` fills: rows of a fused module (this rank's sizes)."""
        if part is None:
            return param
        sizes = self._shard_sizes(param_name.split(".")[-2])
        return param.narrow(0, sum(sizes[:part]), sizes[part])   # type: ignore[index]

    def shard_weight(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor (`TPShard.slice`)."""
        return self.shard.slice(".".join(hf_name.split(".")[-2:]), tensor)

    def _shard_sizes(self, fused: str) -> list[int]:
        s = self.shard
        if fused == "qkv_proj":
            return [s.q_size, s.kv_size, s.kv_size]
        return [s.intermediate, s.intermediate]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors (this rank's slice of each) into the
        (fused) parameters; every part of every parameter must be covered exactly once."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, Hashable]] = set()
        for hf_name, tensor in weights:
            target = self.weight_target(hf_name)
            if target is None:
                continue
            name, part = target
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {self.arch.architecture}")
            _copy(self.part_view(name, params[name].data, part), self.shard_weight(hf_name, tensor), hf_name)
            loaded.add((name, part))
        expected = {(name, part) for name in params for part in self.weight_parts(name)}
        missing = sorted({name for name, _ in expected - loaded})
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)
