"""The bfloat16 matmul roofline of this machine at the model's shapes, and
the model FLOPs of a workload.

`matmul_rates` times the model's projection stack — every layer's
[T x hidden] x [hidden x N] matmuls (qkv, o, gate_up, down), with a distinct
weight copy per layer so weights stream from memory as in a real step — at
several token counts T, with torch.matmul and with oneDNN-packed weights, on
1 thread and on all threads, and keeps the best.
`peak` is the best rate over all T: the machine's bf16 matmul rate at the
model's shapes. A workload's achieved fraction is model FLOPs / wall / peak.
The shape-aware bound additionally charges every step at the rate of its own
token count (small decode steps cannot reach the large-T rate: they stream
the weights once for few rows), which is the fairer ceiling for decode-heavy
workloads.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_TOKENS = (1, 8, 64, 256, 1024, 2048)


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 576
    intermediate: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    vocab: int = 49152

    def projections(self) -> list[tuple[int, int]]:
        """(K, N) of one layer's matmuls."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(self.hidden, q + 2 * kv), (q, self.hidden), (self.hidden, 2 * self.intermediate),
                (self.intermediate, self.hidden)]

    def linear_flops_per_token(self) -> int:
        return 2 * self.num_layers * sum(k * n for k, n in self.projections())

    def lm_head_flops_per_row(self) -> int:
        return 2 * self.hidden * self.vocab

    def attention_flops(self, query_context_pairs: int) -> int:
        """QK^T and PV over all layers for this many (query, visible key) pairs."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * query_context_pairs


def workload_flops(shape: ModelShape, prompt_lens: list[int], max_tokens: int) -> dict[str, float]:
    """Model FLOPs of generating `max_tokens` after each prompt (no prefix reuse)."""
    tokens = sum(prompt_lens) + len(prompt_lens) * (max_tokens - 1)  # the last token is never fed back
    pairs = 0
    for L in prompt_lens:
        pairs += L * (L + 1) // 2                       # causal prefill
        pairs += sum(L + i + 1 for i in range(max_tokens - 1))  # each decode sees its whole context
    linear = shape.linear_flops_per_token() * tokens
    head = shape.lm_head_flops_per_row() * len(prompt_lens) * max_tokens
    attn = shape.attention_flops(pairs)
    return dict(linear=float(linear), lm_head=float(head), attention=float(attn),
                total=float(linear + head + attn))


def _time_stack(fn, weights, inputs, repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in weights:
            for w, k in layer:
                fn(inputs[k], w)
        best = min(best, time.perf_counter() - start)
    return best


def _variants(weights, T: int, dtype: torch.dtype):
    """(matmul fn, per-layer [(weight, K)]) pairs: torch.matmul with [N, K]
    (nn.Linear) weights, and oneDNN-packed weights where this CPU has them."""
    yield (lambda x, w: torch.matmul(x, w.t())), [[(w, w.shape[1]) for w in layer] for layer in weights]
    try:
        if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            packed = [[(torch.ops.mkldnn._reorder_linear_weight(w, max(T, 64)), w.shape[1]) for w in layer]
                      for layer in weights]
            yield (lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")), packed
    except (AttributeError, RuntimeError):
        return


def matmul_rates(shape: ModelShape = ModelShape(), tokens=DEFAULT_TOKENS,
                 dtype: torch.dtype = torch.bfloat16) -> dict[int, float]:
    """{T: best FLOP/s of the model's projection stack at T tokens} over
    torch.matmul and packed oneDNN weights, on 1 thread and on all threads."""
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).to(dtype) for k, n in shape.projections()]
               for _ in range(shape.num_layers)]
    flops_per_token = shape.linear_flops_per_token()
    old = torch.get_num_threads()
    threads = sorted({1, old})
    rates = {}
    try:
        for T in tokens:
            inputs = {k: torch.randn(T, k, generator=gen).to(dtype) for k, _ in shape.projections()}
            best = math.inf
            for fn, ws in _variants(weights, T, dtype):
                for n in threads:
                    torch.set_num_threads(n)
                    _time_stack(fn, ws, inputs, repeats=1)  # warm-up
                    best = min(best, _time_stack(fn, ws, inputs))
            rates[T] = flops_per_token * T / best
    finally:
        torch.set_num_threads(old)
    return rates


def rate_at(rates: dict[int, float], T: int) -> float:
    """Log-linear interpolation of the measured rates (clamped at the ends)."""
    xs = sorted(rates)
    if T <= xs[0]:
        return rates[xs[0]] * T / xs[0] if T < xs[0] else rates[xs[0]]
    if T >= xs[-1]:
        return rates[xs[-1]]
    x = np.log([float(v) for v in xs])
    y = np.log([rates[v] for v in xs])
    return float(np.exp(np.interp(np.log(T), x, y)))


def shape_aware_time(rates: dict[int, float], step_tokens: list[int], shape: ModelShape) -> float:
    """Seconds the projection stack alone needs for these steps at the measured rates."""
    per_token = shape.linear_flops_per_token()
    return sum(per_token * T / rate_at(rates, T) for T in step_tokens if T > 0)
