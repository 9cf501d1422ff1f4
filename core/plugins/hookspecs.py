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
      same behaviour (`setattr(parent, attribute, new)`); a backend replaces
      nothing in a model without it, and skips a role it does not know. Roles:
      "linear": an `nn.Linear` the model only calls (nothing reads its
        weight; not the LM head), replaced by a module with the same call;
      "rms_norm": Hugging Face's RMSNorm over the last dim (`weight`, `eps`;
        normalise in float32, scale in the input dtype) with `forward(x)` and
        `forward_add(x, residual) -> (norm(x + residual), x + residual)`;
      "gated_mlp": `down_proj(silu(gate) * up)` where `gate_up_proj(x)` holds
        gate then up (`intermediate` columns each);
      "rotary": `forward(positions, q [T, Hq, D], k [T, Hkv, D]) -> (q, k)`
        over float32 `cos`/`sin` tables `[max_positions, D]` (rotate_half
        layout); a replacement may rotate in place. One module shared by
        several parents is yielded once per parent: replace it by one module.
    - OPTIONAL `lm_head_weight() -> Tensor [vocab, hidden]`: the matrix
      `compute_logits` multiplies by (the embedding when tied), so a backend
      may compute logits through its own packed copy.
    """

