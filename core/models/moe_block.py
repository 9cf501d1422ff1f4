"""The sparse (mixture-of-experts) feed-forward block and the decoder pieces the MoE families share.

`SparseMoeBlock`: the router `gate` (an `nn.Linear` hidden -> experts, whole on every
tensor-parallel rank, a "linear"), the experts (`FusedMoE`, the "moe" role, this rank's rows of
each expert) and, for Qwen2-MoE, a shared expert (a `GatedMLP`) scaled by
`sigmoid(shared_expert_gate(x))`. The layer's all-reduce sums the ranks' partial outputs.

`MoEForCausalLM` loads the Hugging Face per-expert tensors (`...experts.N.<part>.weight`, what
the hub's checkpoints hold and what transformers 5.24 saves) into the stacked 3-D parameters:
a family names its checkpoint's block (`block_name`) and expert parts (`expert_parts`). A
layer's experts stacked in one tensor per part (`...experts.<part>.weight`, GGUF files) load too.
"""

from __future__ import annotations

import re
from typing import Hashable, Iterable, Iterator

import torch
from torch import nn

from polyrunner.distributed.shard import TPShard
from polyrunner.models.arch import DecoderArch
from polyrunner.models.decoder import DecoderForCausalLM, DecoderLayer
from polyrunner.models.moe_arch import MoEArch
from polyrunner.ops import FusedMoE, GatedMLP

_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_SHARED = re.compile(r"\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\w+)\.weight$")   # all experts in one [E, rows, cols]


class SparseMoeBlock(nn.Module):
    """`[..., H] -> [..., H]`: the routed experts' weighted sum (+ the gated shared expert)."""

    def __init__(self, hidden_size: int, moe: MoEArch, intermediate: int, shared_intermediate: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, hidden_size, intermediate, moe.renormalize, moe.scoring)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate) if moe.shared_expert_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if moe.shared_expert_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out: torch.Tensor = self.experts(flat, self.gate(flat))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(x.shape)


class MoEDecoderLayer(DecoderLayer):
    """A decoder layer whose feed-forward block is sparse where `arch.moe.sparse_layers` says."""

    def make_mlp(self, arch: DecoderArch, layer_idx: int, shard: TPShard) -> nn.Module:
        if arch.moe is None or not arch.moe.sparse_layers[layer_idx]:
            return super().make_mlp(arch, layer_idx, shard)
        return SparseMoeBlock(arch.hidden_size, arch.moe, shard.moe_intermediate, shard.shared_expert_intermediate)

    def mlp_replaceable(self) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
        """A sparse block's router ("linear"), shared expert ("linear"s, "gated_mlp") and experts ("moe")."""
        block = self.mlp
        if not isinstance(block, SparseMoeBlock):
            yield from super().mlp_replaceable()
            return
        yield "linear", block, "gate", block.gate
        shared = block.shared_expert
        if shared is not None:
            yield "linear", shared, "gate_up_proj", shared.gate_up_proj
            yield "linear", shared, "down_proj", shared.down_proj
            yield "gated_mlp", block, "shared_expert", shared
        yield "moe", block, "experts", block.experts


class MoEForCausalLM(DecoderForCausalLM):
    """A decoder with sparse blocks; see `DecoderForCausalLM`. The weight hooks map each expert's
    checkpoint tensors onto a slice of the stacked parameters: part `("gate" | "up", e)` of
    `experts.w13_weight` (rows `[:I]` / `[I:]` of expert e) and `("down", e)` of `experts.w2_weight`."""

    layer_cls = MoEDecoderLayer
    block_name = "mlp"                       # the sparse block's name in the checkpoint
    expert_parts = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}   # checkpoint name -> part

    def _our_name(self, hf_name: str) -> str:
        name = hf_name.removeprefix("model.")
        return name if self.block_name == "mlp" else name.replace(f".{self.block_name}.", ".mlp.")

    def weight_target(self, hf_name: str) -> tuple[str, Hashable] | None:
        name = self._our_name(hf_name)
        m = _EXPERT.match(name)
        if m is None:
            return super().weight_target(name)
        layer, expert, kind = m.groups()
        part = self.expert_parts.get(kind)
        if part is None:
            return name, None   # not a parameter: load_weights names it as unexpected
        return f"layers.{layer}.mlp.experts.{'w2_weight' if part == 'down' else 'w13_weight'}", (part, int(expert))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`DecoderForCausalLM.load_weights`, also taking a layer's experts stacked in one tensor
        per part (`...experts.<part>.weight`, `[E, rows, cols]`, as GGUF files hold them): read
        as E per-expert views of it (no copy), so the per-expert checks and sharding apply."""
        super().load_weights(self._per_expert(weights))

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        experts = self.arch.moe.num_experts if self.arch.moe is not None else 0
        for hf_name, tensor in weights:
            m = _STACKED.match(self._our_name(hf_name))
            if m is None or m.group(2) not in self.expert_parts:
                yield hf_name, tensor
                continue
            if tensor.dim() != 3 or tensor.shape[0] != experts:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected [{experts} experts, "
                                 "rows, columns]")
            base = hf_name.removesuffix(f".{m.group(2)}.weight")
            for e in range(experts):   # a loop over experts: views of the one tensor
                yield f"{base}.{e}.{m.group(2)}.weight", tensor[e]

    def weight_parts(self, param_name: str) -> tuple[Hashable, ...]:
        experts = range(self.arch.moe.num_experts if self.arch.moe is not None else 0)
        if param_name.endswith(".experts.w13_weight"):
            return tuple((part, e) for part in ("gate", "up") for e in experts)
        if param_name.endswith(".experts.w2_weight"):
            return tuple(("down", e) for e in experts)
        return super().weight_parts(param_name)

    def part_view(self, param_name: str, param: torch.Tensor, part: Hashable) -> torch.Tensor:
        if isinstance(part, tuple):   # an expert's slice of a stacked parameter
            kind, expert = part
            if kind == "down":
                return param[expert]
            rows = param.shape[1] // 2
            return param[expert, :rows] if kind == "gate" else param[expert, rows:]
        if param_name.endswith("gate_up_proj.weight") and isinstance(part, int):
            rows = param.shape[0] // 2   # a dense layer's or the shared expert's own width
            return param.narrow(0, part * rows, rows)
        return super().part_view(param_name, param, part)

    def shard_weight(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Experts and the shared expert: this rank's intermediate rows (w1/w3, gate/up) or columns
        (w2, down) at their own widths; everything else as `TPShard.slice` says."""
        s = self.shard
        if s.size == 1:
            return tensor
        name = self._our_name(hf_name)
        expert, shared = _EXPERT.match(name), _SHARED.search(name)
        if expert is not None:
            width, down = s.moe_intermediate, self.expert_parts.get(expert.group(3)) == "down"
        elif shared is not None:
            width, down = s.shared_expert_intermediate, shared.group(1) == "down_proj"
        else:
            return super().shard_weight(name, tensor)
        return tensor.narrow(1 if down else 0, s.rank * width, width)
