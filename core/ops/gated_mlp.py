"""The "gated_mlp" role's reference: `down_proj(silu(gate) * up)`, Llama's MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up [..., 2 * I]`, which holds gate then up (`I` columns each)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """`gate_up_proj` (gate then up, `intermediate` columns each) -> `silu_and_mul` -> `down_proj`."""

    def __init__(self, hidden_size: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
