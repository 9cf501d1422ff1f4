"""The "gated_mlp" role's reference: `down_proj(act(gate) * up)`, Llama's MLP (SiLU) and
Gemma's GeGLU (tanh-approximated GELU)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Hugging Face's activation names (`hidden_act` / `hidden_activation`) -> the function
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `gate_up [..., 2 * I]`, which holds gate then up (`I` columns each)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(gate) * up` of `gate_up [..., 2 * I]` for an `ACTIVATIONS` name."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


class GatedMLP(nn.Module):
    """`gate_up_proj` (gate then up, `intermediate` columns each) -> `act_and_mul` -> `down_proj`.
    `activation` (an `ACTIVATIONS` name) is "silu" for Llama; only then is the module offered
    in the "gated_mlp" role (whose replacements compute SiLU)."""

    def __init__(self, hidden_size: int, intermediate: int, bias: bool = False, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r}; supported: {', '.join(ACTIVATIONS)}")
        self.intermediate = intermediate
        self.activation = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "silu":
            return self.down_proj(silu_and_mul(gate_up))
        return self.down_proj(act_and_mul(gate_up, self.activation))
