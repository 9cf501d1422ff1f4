"""The base of the CPU backend's linear modules, whose kernels take row-major 2-D inputs."""

from __future__ import annotations

import abc

import torch
from torch import nn


class RowLinear(nn.Module, metaclass=abc.ABCMeta):
    """`forward(x [..., in_features]) -> [..., out_features]`: flattens the leading dims, makes
    the rows contiguous and calls `forward_rows(x [M, in_features])`, which a subclass defines."""

    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).reshape(*shape[:-1], self.out_features)
        return self.forward_rows(x if x.stride(1) == 1 else x.contiguous())

    @abc.abstractmethod
    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x [M, in_features]`, rows contiguous -> `[M, out_features]`."""
