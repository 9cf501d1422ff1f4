"""The mixture-of-experts part of a GGUF conversion (`loader.py`): llama.cpp's Mixtral
("llama" with `llama.expert_count` > 0), Qwen2-MoE ("qwen2moe") and Qwen3-MoE ("qwen3moe").

llama.cpp keeps all experts of a layer in one 3-D tensor per projection (PyTorch order,
GGUF lists the dimensions reversed): `blk.N.ffn_gate_exps` / `ffn_up_exps` `[E, I, H]`,
`ffn_down_exps` `[E, H, I]`, and the router `blk.N.ffn_gate_inp` `[E, H]`; Qwen2-MoE's
shared expert is `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp` (`[H]` or
`[1, H]`). A stack keeps its shape under the Hugging Face name of the stacked experts,
`model.layers.N.<block>.experts.<part>.weight` (`<part>` the checkpoint's per-expert name:
w1/w3/w2, gate_proj/up_proj/down_proj): the index records one tensor, read once, which
`MoEForCausalLM.load_weights` views per expert (no per-expert copy). A layer without a router
is dense (Qwen: listed in `mlp_only_layers`; Mixtral has none). The 3-D stacks are never
block-quantized linears (`loader.py` records 2-D matrices only): a dequantised run reads them
densely for the "moe" role; quantized execution reads their blocks (`quantized_experts`) and the
backend runs them as they are (`quantized.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from polyrunner.models.gguf import tensors as gguf_tensors
from polyrunner.models.gguf.blocks import BlockRows, GGUFSource, QuantizedWeight, whole_blocks
from polyrunner.models.gguf.errors import GGUFError

__all__ = ["MOE_ARCHITECTURES", "is_moe", "layer_tensors", "hf_shape", "moe_config", "QuantizedExperts",
           "quantized_experts"]

# GGUF `general.architecture` of a mixture-of-experts file -> (HF class, HF model_type).
MOE_ARCHITECTURES = {
    "llama": ("MixtralForCausalLM", "mixtral"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}   # llama.cpp's per-architecture default
_SOFTMAX = 1   # gguf.ExpertGatingFuncType.SOFTMAX


def is_moe(arch: str, meta: dict[str, Any]) -> bool:
    """Whether a file of GGUF architecture `arch` with metadata `meta` is a mixture of experts."""
    return arch in ("qwen2moe", "qwen3moe") or (arch in MOE_ARCHITECTURES and bool(meta.get(f"{arch}.expert_count")))


def layer_tensors(arch: str) -> dict[str, str]:
    """GGUF per-layer tensor name -> Hugging Face module path in the layer, for the sparse blocks."""
    if arch == "llama":
        return {"ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.w1",
                "ffn_up_exps": "block_sparse_moe.experts.w3", "ffn_down_exps": "block_sparse_moe.experts.w2"}
    return {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
            "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
            "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
            "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}


def hf_shape(gguf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of a tensor of PyTorch-order `shape`: the shared expert's gate,
    `[H]` in llama.cpp's files, is the `[1, H]` weight of a linear; the rest as they are."""
    if gguf_name.endswith(".ffn_gate_inp_shexp.weight") and len(shape) == 1:
        return (1, shape[0])
    return shape


def moe_config(arch: str, meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], hidden: int, layers: int,
               dense_intermediate: int | None, path: Path) -> dict[str, Any]:
    """The config.json fields of a mixture-of-experts file (class, model type, expert counts and
    widths, which layers are sparse), every sparse layer's tensors checked against them first
    (`shapes`: every GGUF tensor's PyTorch-order shape). GGUFError names a tensor with the wrong
    shape, a missing one, or a routing this runner does not implement."""
    hf_class, model_type = MOE_ARCHITECTURES[arch]
    experts = int(_need(meta, f"{arch}.expert_count", path))
    top_k = int(_need(meta, f"{arch}.expert_used_count", path))
    gating = meta.get(f"{arch}.expert_gating_func", _SOFTMAX)
    if gating != _SOFTMAX:
        raise GGUFError(f"{path}: {arch}.expert_gating_func {gating} is not supported (supported: {_SOFTMAX}, softmax)")
    scale = meta.get(f"{arch}.expert_weights_scale", 1.0)
    if scale != 1.0:
        raise GGUFError(f"{path}: {arch}.expert_weights_scale {scale} is not supported (supported: 1.0)")
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in shapes for i in range(layers)]
    if not any(sparse):
        raise GGUFError(f"{path}: {arch}.expert_count is {experts} but no layer has a router "
                        "(blk.N.ffn_gate_inp.weight)")
    first = sparse.index(True)
    width = meta.get(f"{arch}.expert_feed_forward_length")
    if width is None:   # llama.cpp's Mixtral files: feed_forward_length is the experts' width
        width = meta.get(f"{arch}.feed_forward_length") if arch == "llama" else None
    if width is None:
        width = _shape(shapes, f"blk.{first}.ffn_gate_exps.weight", path)[1]
    width = int(width)
    shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0)
    if arch == "qwen2moe" and not shared and f"blk.{first}.ffn_gate_shexp.weight" in shapes:
        shared = _shape(shapes, f"blk.{first}.ffn_gate_shexp.weight", path)[0]
    for i in (i for i, s in enumerate(sparse) if s):
        _check_layer(shapes, i, experts, width, hidden, shared, path)
    out: dict[str, Any] = {"architectures": [hf_class], "model_type": model_type, "num_experts_per_tok": top_k}
    if arch == "llama":
        if not all(sparse):
            raise GGUFError(f"{path}: layer {sparse.index(False)} has no router (blk.{sparse.index(False)}."
                            "ffn_gate_inp.weight); every layer of a Mixtral model is sparse")
        out.update(num_local_experts=experts, intermediate_size=width, sliding_window=None)
        return out
    out.update(num_experts=experts, moe_intermediate_size=width, decoder_sparse_step=1,
               mlp_only_layers=[i for i, s in enumerate(sparse) if not s],
               norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", _NORM_TOPK[arch])),
               intermediate_size=int(dense_intermediate or width))
    if arch == "qwen2moe":
        out.update(shared_expert_intermediate_size=shared, use_sliding_window=False)
    return out


def _check_layer(shapes: dict[str, tuple[int, ...]], i: int, experts: int, width: int, hidden: int, shared: int,
                 path: Path) -> None:
    """A sparse layer's router, expert stacks (and shared expert) have the config's shapes."""
    why = f"expert_count {experts}, expert width {width}, embedding_length {hidden}"
    want = {"ffn_gate_inp": (experts, hidden), "ffn_gate_exps": (experts, width, hidden),
            "ffn_up_exps": (experts, width, hidden), "ffn_down_exps": (experts, hidden, width)}
    if shared:
        why += f", shared expert width {shared}"
        want.update(ffn_gate_shexp=(shared, hidden), ffn_up_shexp=(shared, hidden), ffn_down_shexp=(hidden, shared))
    for kind, expected in want.items():
        name = f"blk.{i}.{kind}.weight"
        got = _shape(shapes, name, path)
        if got != expected:
            raise GGUFError(f"{path}: tensor {name!r} has shape {list(got)} (PyTorch order), expected "
                            f"{list(expected)} ({why})")
    gate = f"blk.{i}.ffn_gate_inp_shexp.weight"
    if shared and hf_shape(gate, _shape(shapes, gate, path)) != (1, hidden):
        raise GGUFError(f"{path}: tensor {gate!r} has shape {list(shapes[gate])} (PyTorch order), expected "
                        f"[{hidden}] or [1, {hidden}]")


def _shape(shapes: dict[str, tuple[int, ...]], name: str, path: Path) -> tuple[int, ...]:
    if name not in shapes:
        raise GGUFError(f"{path}: the file has no tensor {name!r} (a sparse layer needs it)")
    return shapes[name]


def _need(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
    return meta[key]


# ------------------------------------------------------------------ quantized execution


@dataclass(frozen=True)
class QuantizedExperts:
    """One sparse layer's experts in GGUF blocks, each stack as the file holds it: `gate` and `up`
    (`[E * I, H]`, expert e's rows `e * I ..`; one GGML type) and `down` (`[E * H, I]`), read when a
    backend asks (`QuantizedWeight.blocks`: a view of the file's pages); `num_experts`, and
    `sources`, the checkpoint names of the three stacks."""

    gate: QuantizedWeight
    up: QuantizedWeight
    down: QuantizedWeight
    num_experts: int
    sources: tuple[str, ...]


def quantized_experts(model: nn.Module, modules: Iterable[tuple[nn.Module, str, nn.Module]], folder: str | Path
                      ) -> Iterator[tuple[nn.Module, str, nn.Module, QuantizedExperts]]:
    """`(parent, attribute, module, experts)` for each "moe" module of `modules` (`(parent,
    attribute, module)`, from the model's `replaceable_modules()`) whose stacks the folder's GGUF
    file holds block-quantized: gate and up of one type, shapes `[E, I, H]` / `[E, H, I]` as
    the module's. Others (float stacks, mixed gate/up types) are left out: they load densely.
    The stacks' names come from the model's `block_name` and `expert_parts` (`MoEForCausalLM`).
    Nothing is read here."""
    names = {id(m): name for name, m in model.named_modules()}
    block = getattr(model, "block_name", "mlp")
    part_names = {part: name for name, part in getattr(model, "expert_parts", {}).items()}
    index = gguf_tensors.read_index(folder)
    source: GGUFSource | None = None
    for parent, attr, module in modules:
        prefix = names[id(module)].removesuffix(".experts").replace(".mlp", f".{block}")
        sources = tuple(f"model.{prefix}.experts.{part_names.get(p)}.weight" for p in ("gate", "up", "down"))
        stacks = [index["tensors"].get(name) for name in sources]
        if not _quantized_stacks(stacks, module):
            continue
        source = source or GGUFSource.of(gguf_tensors.checked_source(index))
        gate, up, down = (_stack(t, source) for t in stacks if t is not None)
        num = int(index["tensors"][sources[0]]["shape"][0])
        yield parent, attr, module, QuantizedExperts(gate, up, down, num, sources)


def _stack(t: dict[str, Any], source: GGUFSource) -> QuantizedWeight:
    """A 3-D stack `[E, rows, cols]` as the 2-D weight `[E * rows, cols]` of its bytes in the file."""
    experts, rows, cols = t["shape"]
    return QuantizedWeight(t["type"], (experts * rows, cols), source=source,
                           parts=[BlockRows(t["offset"], experts * rows, t["nbytes"] // (experts * rows))])


def _quantized_stacks(stacks: list[dict[str, Any] | None], module: nn.Module) -> bool:
    """Whether the three stack entries exist, are block-quantized (`BLOCK_SIZES`: float stacks are not)
    with whole blocks per row, gate and up of one type, and have the module's shapes."""
    if any(t is None for t in stacks):
        return False
    gate, up, down = stacks
    assert gate is not None and up is not None and down is not None
    experts, inter = getattr(module, "num_experts", 0), getattr(module, "intermediate", 0)
    hidden = gate["shape"][-1]
    if gate["type"] != up["type"]:
        return False
    want = [experts, inter, hidden]
    if (gate["shape"], up["shape"], down["shape"]) != (want, want, [experts, hidden, inter]):
        return False
    return all(whole_blocks(t["type"], t["shape"], t["nbytes"]) for t in stacks)

