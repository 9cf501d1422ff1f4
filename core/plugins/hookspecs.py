"""Hook specifications: the only ways a plugin extends polyrunner.

A plugin is any object (usually a module) with functions marked `@hookimpl`
whose names match the specs below. Built-in backends are plugins registered
through the `polyrunner.backends` entry-point group, exactly like third-party
ones; user code may also call `polyrunner.plugins.register(obj)` at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from polyrunner.device.backend import Backend

PROJECT = "polyrunner"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def polyrunner_backends() -> "list[type[Backend]]":
    """Return the Backend subclasses this plugin contributes.

    Must not import the device library: classes are probed later with
    `Backend.probe()`, which reports a missing library as unavailable.
    Backend names must be unique across all plugins.
    """


@hookspec
def polyrunner_models() -> "dict[str, type]":
    """Return model classes keyed by the Hugging Face architecture name
    (`config.json` "architectures"), e.g. {"LlamaForCausalLM": MyLlama}.
    A later-registered plugin overrides an earlier one for the same name.

    A model class provides (see `polyrunner.models.llama.LlamaForCausalLM`):

    - `cls(arch: DecoderArch, attention_op, max_positions: int)`: built on the
      meta device, then moved to the device and dtype (buffers a module must
      recompute afterwards: its `reset_buffers()` is called);
    - `load_weights(weights: Iterable[tuple[str, Tensor]])`: Hugging Face-named
      tensors, already in the model's dtype; every parameter covered once;
    - `forward(input_ids [T], positions [T], attn_metadata, kv_caches) -> hidden
      [T, hidden]`, calling `attention_op(q, k, v, kv_caches[layer],
      attn_metadata, layer_spec)` once per layer;
    - `compute_logits(hidden [N, hidden]) -> float32 logits [N, vocab]`;
    - OPTIONAL `replaceable_modules()`: yields `(role, parent, attribute,
      module)` for the parts a backend may replace with a faster module of the
      same behaviour (`Backend.op_overrides`, applied by the core with
      `setattr(parent, attribute, new)`); nothing is replaced in a model
      without it, and other roles than the table's are skipped. It is walked
      once per overridden role, each walk reading the current attributes; a
      module shared by several parents is yielded once per parent. The roles ("linear",
      "rms_norm", "rotary", "gated_mlp"), their reference modules and the
      call each replacement keeps: `polyrunner.ops.ROLES` (core/ops/roles.py).
    - OPTIONAL `lm_head_weight() -> Tensor [vocab, hidden] | None`: the matrix
      `compute_logits` multiplies by (the embedding when tied), so a backend
      may compute logits through its own packed copy; None when a backend's
      quantized LM head (`Backend.quantize_model`) replaced it.
    """

