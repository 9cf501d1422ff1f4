"""Launch parameters of the fused-MoE kernel (`triton_moe.fused_moe_kernel`), per shape.

`TABLE` maps (M regime, dtype class) to the tile sizes (vLLM's `BLOCK_SIZE_M/N/K`,
`GROUP_SIZE_M`), `num_warps` and `num_stages`:

- M regime by the mean (token, expert) pairs per expert, `T * k / E`: "small" (<= 16, decode:
  most experts get a few rows, so 16-row blocks waste the least padding, as vLLM's default
  config for `M <= E`), "medium" (<= 64) and "large" (prefill: 64-row blocks reuse each
  weight tile over more rows);
- dtype class "half" (float16/bfloat16: tensor-core dots, float32 accumulation) or "float32"
  (IEEE float32 dots on the FMA units: smaller K tiles, fewer stages).

tests/test_triton_moe.py compiles every entry for sm_90 with the triton wheel's ptxas and checks
that none spills registers or overflows shared memory. The launch depends only on `T`, `k`, `E`
and the dtype (never on the routing), so it is the same at CUDA-graph capture and replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Regime = Literal["small", "medium", "large"]
DtypeClass = Literal["half", "float32"]
SMALL_PAIRS_PER_EXPERT = 16
MEDIUM_PAIRS_PER_EXPERT = 64


@dataclass(frozen=True)
class MoELaunch:
    """One launch of the fused-MoE kernel: a program computes a BLOCK_SIZE_M x BLOCK_SIZE_N output
    tile over K in steps of BLOCK_SIZE_K; GROUP_SIZE_M M blocks share their N tiles (L2 reuse)."""
    block_size_m: int
    block_size_n: int
    block_size_k: int
    group_size_m: int
    num_warps: int
    num_stages: int


TABLE: dict[tuple[Regime, DtypeClass], MoELaunch] = {
    ("small", "half"): MoELaunch(16, 64, 64, 1, 4, 3),
    ("medium", "half"): MoELaunch(32, 64, 64, 8, 4, 3),
    ("large", "half"): MoELaunch(64, 128, 64, 8, 8, 3),
    ("small", "float32"): MoELaunch(16, 64, 32, 1, 4, 2),
    ("medium", "float32"): MoELaunch(32, 64, 32, 8, 8, 2),
    ("large", "float32"): MoELaunch(64, 64, 32, 8, 8, 2),
}


def regime(num_tokens: int, top_k: int, num_experts: int) -> Regime:
    """The M regime of `num_tokens` tokens routed to `top_k` of `num_experts` experts each."""
    pairs = num_tokens * top_k
    if pairs <= SMALL_PAIRS_PER_EXPERT * num_experts:
        return "small"
    return "medium" if pairs <= MEDIUM_PAIRS_PER_EXPERT * num_experts else "large"


def dtype_class(dtype: torch.dtype) -> DtypeClass:
    """"float32" for float32, else "half"."""
    return "float32" if dtype == torch.float32 else "half"


def launch_for(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoELaunch:
    """The TABLE entry for a launch over `num_tokens` tokens in `dtype`."""
    return TABLE[regime(num_tokens, top_k, num_experts), dtype_class(dtype)]
