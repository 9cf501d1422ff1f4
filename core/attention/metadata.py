"""The attention metadata shared by every backend.

Tokens of a step are laid out request after request (decodes first). For a
batch padded to `T_pad` tokens and `R_pad` requests the tail invariants hold:

- `query_start_loc[R+1:] == T` (non-decreasing),
- `seq_lens[R:] == 0`,
- `slot_mapping[T:] == NULL_SLOT` (padded tokens write the reserved null block),
- `block_tables[R:] == NULL_BLOCK`, `token_to_req[T:] == 0`, `positions[T:] == 0`.

Outputs of padded tokens are garbage and never read; kernels must not let
them disturb real rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

NULL_BLOCK = 0  # block 0 of every KV pool is reserved; padded tokens write here
NULL_SLOT = 0   # slot 0 = first slot of the null block


@dataclass(frozen=True)
class LayerSpec:
    """Static per-layer attention facts the op needs."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None   # scores become cap * tanh(scores / cap) (Gemma 2), vLLM's name


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, on the backend's device unless named `*_np`."""

    num_actual_tokens: int          # T, unpadded
    num_reqs: int                   # R, unpadded
    num_decodes: int                # leading requests with exactly one query token
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor   # [R_pad + 1] int32
    seq_lens: torch.Tensor          # [R_pad] int32 (context incl. this step's tokens)
    block_tables: torch.Tensor      # [R_pad, max_blocks_per_req] int32
    slot_mapping: torch.Tensor      # [T_pad] int64
    positions: torch.Tensor         # [T_pad] int64
    token_to_req: torch.Tensor      # [T_pad] int32
    # Host copies (numpy) for backends that dispatch per request on the host.
    query_start_loc_np: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int32))
    seq_lens_np: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # Backend-specific additions: Backend.host_attention_extras' arrays (on the device), executor flags.
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def num_padded_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_padded_reqs(self) -> int:
        return int(self.seq_lens.shape[0])
