"""One padded step through the backend's attention op, outside any engine:
the step the kv_cache and execution checks write and attend with, and the
host stand-in that builds the reference metadata for it."""

from __future__ import annotations

import numpy as np
import torch

from polyrunner.attention.metadata import LayerSpec
from polyrunner.tools.conformance.batches import make_batch, model_inputs


def write_step(ctx, backend, num_blocks: int):
    """A decode-first step (decode at position >= 1 first) padded past its
    real size on both axes, on distinct blocks."""
    rng = np.random.default_rng(ctx.settings.seed + 7)
    counts = np.array([1, 1, 5, 3], np.int32)
    spec = ctx.kv_spec()
    batch = make_batch(rng, counts, vocab=ctx.arch.vocab_size, block_size=spec.block_size,
                       max_model_len=ctx.settings.max_model_len, num_blocks=num_blocks,
                       context_budget=10 * spec.block_size, min_decode_context=spec.block_size + 1)
    T, R = batch.num_step_tokens, batch.num_reqs
    policy = backend.bucket_policy()
    try:  # padded tokens always; a padded request too unless R is the largest request bucket
        T_pad, R_pad = policy.pad(T + 3, R + 1)
    except ValueError:
        T_pad, R_pad = policy.pad(T + 3, R)
    return batch, batch.step(max(T_pad, T + 3), max(R_pad, R))


def attend(ctx, backend, step, caches, layer: int, rng, sliding_window: int | None = None,
           logits_soft_cap: float | None = None):
    """Random q/k/v for every (padded) token of `step` through `backend.attention`
    on `caches[layer]`: (q, k, v, output, layer_spec), q/k/v on the host. The layer
    has the given window and soft cap (default: neither)."""
    spec = ctx.kv_spec()
    a = ctx.arch
    layer_spec = LayerSpec(a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim ** -0.5, sliding_window,
                           logits_soft_cap)
    inputs = model_inputs(backend, step, caches)
    T_pad = len(step.slot_mapping)
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    q = torch.randn(T_pad, a.num_heads, a.head_dim, generator=gen).to(spec.dtype)
    k = torch.randn(T_pad, a.num_kv_heads, a.head_dim, generator=gen).to(spec.dtype)
    v = torch.randn(T_pad, a.num_kv_heads, a.head_dim, generator=gen).to(spec.dtype)
    with backend.no_grad():
        out = backend.attention(backend.to_device(q), backend.to_device(k), backend.to_device(v),
                                caches[layer], inputs.attn, layer_spec)
    backend.synchronize()
    return q, k, v, out, layer_spec


class HostDevice:
    """The host as a 'device' for building reference metadata."""

    @staticmethod
    def to_device(a):
        return torch.from_numpy(a) if isinstance(a, np.ndarray) else a

    @staticmethod
    def host_attention_extras(step):
        return {}
