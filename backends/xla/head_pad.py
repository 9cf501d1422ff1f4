"""Head size padded to a multiple of 128 at the attention op's boundary (the TPU's lane width).

Pallas ragged paged attention takes head sizes that are multiples of 128 only; vLLM's TPU
backend pads to `TPU_HEAD_SIZE_ALIGNMENT = 128`. Here q, k and v get zero columns up to the
padded size, the KV cache is allocated at that size, and the output is sliced back. Zero
columns add nothing to q·k, and the padded output columns are sums of zero value columns, so
the result equals unpadded attention; the softmax scale stays the real head size's
(`LayerSpec.scale`, never recomputed from the padded size).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from polyrunner.plugin_api import KVCacheSpec, cdiv

TPU_HEAD_SIZE_ALIGNMENT = 128


def padded_head_size(head_size: int) -> int:
    """`head_size` rounded up to a multiple of 128."""
    return cdiv(head_size, TPU_HEAD_SIZE_ALIGNMENT) * TPU_HEAD_SIZE_ALIGNMENT


def padded_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The KV cache of `spec` at the padded head size (what is allocated and budgeted)."""
    return dataclasses.replace(spec, head_size=padded_head_size(spec.head_size))


def pad_heads(x: torch.Tensor, size: int) -> torch.Tensor:
    """`[..., D]` -> `[..., size]` with zero columns (a no-op when D == size)."""
    extra = size - x.shape[-1]
    return x if extra == 0 else F.pad(x, (0, extra))
