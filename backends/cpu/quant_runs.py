"""A fused linear whose checkpoint parts are of several GGUF types, run quantized as one run per type.

llama.cpp's "_M" and "_S" mixes store some parts of what the model runs as one fused linear at
another type: a Q4_K_M file has `attn_v` in Q6_K next to Q4_K `attn_q` / `attn_k` in about half the
layers, and other mixes differ between `ffn_gate` and `ffn_up`. Such a linear cannot be one
`QuantLinear` (one type per matrix); `QuantizedModel.mixed` gives its runs of consecutive
same-typed parts, and `quant_linear.quantize_model` makes a `QuantRunsLinear` of one `QuantLinear`
per run, so no dense float copy of the fused weight is ever made.

A call allocates the output once and each run writes its column slice of it (`forward_into`: the
kernel writes at the slice's address with the full row stride), so nothing is concatenated or
copied on the decode path: the calls are the same kernel calls a single `QuantLinear` makes, one
per run, which a CPU graph records (the slices are views, the output comes from its arena). Each
run quantizes the input to int8 again (a row of K values per run: small next to its weight stream).
LoRA wraps it like any linear (`lora_module.py` adds to the output of `base(x)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from polyrunner.backends.cpu.row_linear import RowLinear


class SliceWriter(Protocol):
    """What a run is (a `quant_linear.QuantLinear` without a bias): `forward_into(x [M, in_features], out)`
    writes `x @ W^T` into `out`, an `[M, out_features]` view with unit column stride and any row stride,
    in out's dtype; steps of more than `dense_above` rows take its dense path."""

    in_features: int
    out_features: int
    dense_above: int

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> None: ...


class QuantRunsLinear(RowLinear):
    """`x @ W^T + bias` where W's rows are the runs' rows in order (see the module docstring); the
    output in `out_dtype`, or the input's dtype when None. `runs` are modules (`SliceWriter`s) of one
    input width; `bias` (the dense layer's Parameter, loaded later in place) covers all their rows."""

    def __init__(self, runs: Sequence[SliceWriter], bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if len(runs) < 2 or len({r.in_features for r in runs}) != 1:
            raise ValueError(f"a QuantRunsLinear needs at least two runs of one input width, got "
                             f"{[(r.out_features, r.in_features) for r in runs]}")
        self.runs = nn.ModuleList(runs)   # type: ignore[arg-type]   # every run is a module
        self.in_features = runs[0].in_features
        self.out_features = sum(r.out_features for r in runs)
        self.out_dtype = out_dtype
        # the executor's pool row limit: steps up to this many rows run every run's integer kernel
        self.dense_above = min(r.dense_above for r in runs)
        ends = [0]
        for r in runs:
            ends.append(ends[-1] + r.out_features)
        self._slices = [(run, a, b) for run, a, b in zip(runs, ends, ends[1:])]
        self.bias = bias if isinstance(bias, nn.Parameter) or bias is None else nn.Parameter(bias.detach(), False)

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty((x.shape[0], self.out_features), dtype=self.out_dtype or x.dtype)
        for run, a, b in self._slices:   # one kernel call per run, each into its columns
            run.forward_into(x, y[:, a:b])
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
