"""Rotary tables for rope_type "longrope" (Phi-3's LongRoPE, "su" in older configs).

Each of the head_dim / 2 frequencies is divided by a per-frequency factor: `short_factor` for
positions below `original_max_position_embeddings` (the pretraining length), `long_factor`
from there on; cos and sin are multiplied by `attention_factor`
(`polyrunner.models.longrope.longrope_scaling` resolves it). The math is transformers'
`_compute_longrope_parameters`.

The factors are chosen per position (row p of the table uses the long factors iff
p >= original_max_position_embeddings), so a token's rotation does not depend on the other
tokens of its step: the same under any batching, chunking or preemption, and a cached key
never needs recomputing. transformers picks one set per forward from the largest position
(long iff max(position) + 1 > original; Phi-3's `generate` re-encodes the whole sequence
when it first outgrows the original length), so once a sequence is longer than that it
rotates every position with the long factors, the positions below too: it agrees with this
table only while a sequence stays below the original length (and, row by row, for positions
all at or above it). vLLM's Phi3LongRoPEScaledRotaryEmbedding chooses per step: the long
factors for every token of the batch when any position exceeds the original length.
"""

from __future__ import annotations

from typing import Any

import torch


def longrope_tables(head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin `[max_positions, head_dim]` (rotate_half layout: the frequencies twice)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * theta ** exponent)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * theta ** exponent)
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    inv_freq = torch.where(positions < scaling["original_max_position_embeddings"], short, long)
    freqs = positions * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = scaling["attention_factor"]
    return emb.cos() * factor, emb.sin() * factor
