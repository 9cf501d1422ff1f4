"""Quantized execution of a GGUF model: which weights stay in GGUF blocks.

A converted GGUF folder (`loader.py`) records in `gguf_quantized.json` where
each quantized matrix's blocks lie in the GGUF file. When quantized execution
is on (`select_quantization`), the engine matches them (`quantized_model`)
to the model's "linear" modules (a fused linear such as `qkv_proj`
stacks the rows of its checkpoint parts, named by the model's vLLM-style
`packed_modules_mapping`), to the LM head, the token embedding and the "moe"
modules' 3-D expert stacks (`moe.quantized_experts`), and hands them to the backend's
`quantize_model` before any dense weight is read; the backend swaps in modules
that compute with the blocks as they are, and the dense weights of the swapped
modules are then never read (`QuantizedModel.replaced_weights`).
Device-neutral: blocks are host numpy bytes; what runs them is the backend's.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from polyrunner.models.gguf import moe as gguf_moe
from polyrunner.models.gguf import tensors as gguf_tensors
from polyrunner.models.gguf.blocks import BlockRows, GGUFSource, QuantizedWeight, whole_blocks
from polyrunner.models.gguf.errors import GGUFError

logger = logging.getLogger(__name__)

@dataclass
class QuantizedModel:
    """What `Backend.quantize_model` receives: `linears`, one `(parent, attribute,
    module, weight)` per "linear" of the model (`module` is the dense layer,
    `setattr(parent, attribute, new)` swaps it; its bias, if any, stays in
    `module.bias`), and `lm_head`, the `[vocab, hidden]` matrix `compute_logits`
    multiplies by (the embedding when tied), or None when it is not quantized.
    `embedding`: the token embedding's `[vocab, hidden]` blocks (the `lm_head` object itself
    when tied), None when not quantized; a backend may swap `model.embed_tokens` for a module
    that looks rows up in them (`forward(input_ids) -> [..., hidden]` in the model's dtype), and,
    for an untied quantized head, `model.lm_head` for the module that computes the logits
    (the one it sets as `model.quantized_lm_head`). `experts`: `(parent, attribute, module,
    experts)` per "moe" module whose stacks are block-quantized (`moe.QuantizedExperts`),
    swapped by `setattr(parent, attribute, new)` for a module of the same call. `mixed`: `(parent,
    attribute, module, runs)` per fused linear whose parts are of several types (llama.cpp's Q4_K_M
    files store `attn_v` in Q6_K next to Q4_K `attn_q` / `attn_k` in half the layers): `runs` are its
    consecutive same-typed parts stacked, in row order (at least two types; their rows sum to the
    module's, one width); a backend that leaves it (or does not read this field) keeps it dense."""

    linears: list[tuple[nn.Module, str, nn.Module, QuantizedWeight]] = field(default_factory=list)
    lm_head: QuantizedWeight | None = None
    sources: dict[int, list[str]] = field(default_factory=dict)  # id(dense module) -> its checkpoint weights
    embedding: QuantizedWeight | None = None
    experts: list[tuple[nn.Module, str, nn.Module, gguf_moe.QuantizedExperts]] = field(default_factory=list)
    # (parent, attribute, module, checkpoint names) of the embedding, the untied LM head and the experts
    others: list[tuple[nn.Module, str, nn.Module, tuple[str, ...]]] = field(default_factory=list)
    mixed: list[tuple[nn.Module, str, nn.Module, list[QuantizedWeight]]] = field(default_factory=list)

    def replaced_weights(self) -> set[str]:
        """Checkpoint names of the weights of the modules the backend swapped out."""
        places = [(parent, attr, dense) for parent, attr, dense, _ in self.linears]
        places += [(parent, attr, dense) for parent, attr, dense, _ in self.mixed]
        linears = {name for parent, attr, dense in places if getattr(parent, attr) is not dense
                   for name in self.sources[id(dense)]}
        return linears | {name for parent, attr, dense, names in self.others if getattr(parent, attr) is not dense
                          for name in names}


def checkpoint_quantization(hf_config: dict[str, Any]) -> str | None:
    """"gguf" when the folder is a converted GGUF whose weight matrices are quantized, else None."""
    gguf = hf_config.get("polyrunner_gguf") or {}
    return "gguf" if gguf.get("quantized_weights") else None


def select_quantization(requested: str | None, dtype: str, hf_config: dict[str, Any], backend: Any,
                        model: str | None = None) -> str | None:
    """The quantization the engine runs (None: dequantised weights).

    `requested` is `ModelConfig.quantization`: None runs the checkpoint's format
    when `model` is a .gguf file (None: the embedded default, one too; its
    converted folder given as a folder stays dequantised, as benchmarks against
    other runners use it), the backend executes the format
    (`backend.supported_quantization`) and `dtype` is "auto" (an explicit dtype
    dequantises); "gguf" demands it (vLLM's errors when the checkpoint or the
    backend disagrees)."""
    found = checkpoint_quantization(hf_config)
    supported = tuple(getattr(backend, "supported_quantization", ()))
    if requested is None:
        gguf_file = model is None or Path(model).suffix == ".gguf"
        return found if found is not None and found in supported and dtype == "auto" and gguf_file else None
    if found != requested:
        raise ValueError(f"Quantization method specified in the model config ({found}) does not match the "
                         f"quantization method specified in the `quantization` argument ({requested}).")
    if requested not in supported:
        raise ValueError(f"{requested} quantization is currently not supported in {backend.name}.")
    return requested


def quantizer(backend: Any, folder: str | Path, hf_config: dict[str, Any]) -> Callable[[nn.Module], set[str]]:
    """`load_model`'s `prepare` for quantized execution: `backend.quantize_model`
    swaps the built (not yet loaded) model's modules; returns the checkpoint
    names that are then not read."""
    def prepare(model: nn.Module) -> set[str]:
        started = time.perf_counter()
        qm = quantized_model(model, folder, hf_config)
        swapped = backend.quantize_model(model, qm)
        logger.info("quantization gguf: %d modules run quantized by backend %s (blocks read and prepared in "
                    "%.1f s)", swapped, backend.name, time.perf_counter() - started)
        return qm.replaced_weights()
    return prepare


def read_quantized_weights(folder: str | Path, hf_config: dict[str, Any]) -> dict[str, QuantizedWeight]:
    """Every quantized matrix of a converted GGUF folder, by Hugging Face tensor name: where
    its blocks lie in the GGUF file (q/k rows to un-permute), checked against the type's
    block size; nothing is read (`QuantizedWeight.blocks` reads when a backend asks)."""
    name = (hf_config.get("polyrunner_gguf") or {}).get("quantized_weights")
    if not name:
        return {}
    index = json.loads((Path(folder) / name).read_text())
    src = Path(index["source"])
    if gguf_tensors.is_gguf_folder(folder):
        gguf_tensors.checked_source(gguf_tensors.read_index(folder))   # gone or changed: a clear error
    if not src.is_file():
        raise GGUFError(f"{folder}: its GGUF file {src} is gone; convert it again")
    source = GGUFSource.of(src)
    out = {}
    for hf_name, t in index["tensors"].items():
        rows, cols = t["shape"]
        if not whole_blocks(t["type"], (rows, cols), t["nbytes"]) or t["offset"] + t["nbytes"] > source.size:
            raise GGUFError(f"{src}: tensor {hf_name!r} ({t['type']}, {rows}x{cols}) has {t['nbytes']} bytes "
                            f"at offset {t['offset']}")
        part = BlockRows(t["offset"], rows, t["nbytes"] // rows, t["permute_heads"] or None)
        out[hf_name] = QuantizedWeight(t["type"], (rows, cols), source=source, parts=[part])
    return out


def quantized_model(model: nn.Module, folder: str | Path, hf_config: dict[str, Any]) -> QuantizedModel:
    """Match the folder's quantized matrices to the model's "linear" modules (from
    its `replaceable_modules()` hook) and its LM head. A fused linear gets its
    parts' rows stacked when they share one type, and is in `mixed` (its runs of one
    type stacked) when they do not; otherwise (a part not quantized, a shape that
    disagrees) it is left out and stays dense."""
    weights = read_quantized_weights(folder, hf_config)
    names = {id(module): name for name, module in model.named_modules()}
    packed = getattr(model, "packed_modules_mapping", {})
    result = QuantizedModel()
    hook = getattr(model, "replaceable_modules", None)
    for role, parent, attr, module in (hook() if hook is not None else ()):
        if role != "linear" or not isinstance(module, nn.Linear):
            continue
        prefix, _, leaf = names[id(module)].rpartition(".")
        found = [_find(weights, f"{prefix}.{p}" if prefix else p) for p in packed.get(leaf, [leaf])]
        parts, shape = [weights.get(name) for name in found], (module.out_features, module.in_features)
        runs = _runs(parts, shape)
        if runs is not None and len(runs) == 1:
            result.linears.append((parent, attr, module, runs[0]))
        elif runs is not None:
            result.mixed.append((parent, attr, module, runs))
        if runs is not None:
            result.sources[id(module)] = found
    head = "embed_tokens" if hf_config.get("tie_word_embeddings") else "lm_head"
    result.lm_head = weights.get(_find(weights, head))
    _match_embedding_and_head(model, weights, result, tied=head == "embed_tokens")
    moe = [(parent, attr, module) for role, parent, attr, module in (hook() if hook is not None else ())
           if role == "moe"]
    for parent, attr, module, experts in gguf_moe.quantized_experts(model, moe, folder) if moe else ():
        result.experts.append((parent, attr, module, experts))
        result.others.append((parent, attr, module, experts.sources))
    return result


def _match_embedding_and_head(model: nn.Module, weights: dict[str, QuantizedWeight], result: QuantizedModel,
                              tied: bool) -> None:
    """`result.embedding` (and its place) when the token embedding is quantized with the model's
    shape; the untied LM head's place when it is quantized."""
    name = _find(weights, "embed_tokens")
    embed, lm_head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    quantized = weights.get(name)
    if quantized is not None and isinstance(embed, nn.Embedding) and tuple(embed.weight.shape) == quantized.shape:
        result.embedding = quantized
        result.others.append((model, "embed_tokens", embed, (name,)))
    if not tied and result.lm_head is not None and isinstance(lm_head, nn.Linear):
        result.others.append((model, "lm_head", lm_head, (_find(weights, "lm_head"),)))


def _find(weights: dict[str, QuantizedWeight], module_name: str) -> str:
    """The checkpoint name of a module's weight (Hugging Face names carry a "model." prefix)."""
    return f"model.{module_name}.weight" if f"model.{module_name}.weight" in weights else f"{module_name}.weight"


def _runs(parts: list[QuantizedWeight | None], shape: tuple[int, int]) -> list[QuantizedWeight] | None:
    """A linear's parts (its checkpoint matrices, in row order) as runs of consecutive same-typed parts,
    each stacked: one run when they share a type (the whole linear), several for a fused linear of mixed
    types; None when a part is not quantized or the shapes disagree with the module's `shape`."""
    known = [p for p in parts if p is not None]
    if not known or len(known) != len(parts):
        return None
    if sum(p.shape[0] for p in known) != shape[0] or any(p.shape[1] != shape[1] for p in known):
        return None
    runs = [list(group) for _, group in itertools.groupby(known, key=lambda p: p.qtype)]
    return [QuantizedWeight.stacked(run, (sum(p.shape[0] for p in run), shape[1])) for run in runs]
