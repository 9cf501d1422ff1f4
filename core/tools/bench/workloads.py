"""The benchmark workloads, defined once (numpy only, so a foreign runner's
venv can load this file by path and run exactly the same requests).

All workloads: SmolLM2-135M-Instruct in polyrunner's dtype "auto" (bfloat16 on
a CPU with AVX512_BF16 or AMX, else float32), greedy, ignore_eos.

- w1 throughput: 64 requests, random prompts of length U[32, 512], 128 output tokens.
- w2 decode-heavy: 8 requests, 32-token prompts, 512 output tokens.
- w3 single stream: 1 request, 32-token prompt, 256 output tokens.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

VOCAB = 49152
# Token ids below this are avoided (special tokens of SmolLM2's tokenizer).
MIN_TOKEN = 3


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _random_prompts(rng: np.random.Generator, lengths: list[int]) -> list[list[int]]:
    return [rng.integers(MIN_TOKEN, VOCAB, size=n).tolist() for n in lengths]


def make_workload(name: str) -> Workload:
    rng = np.random.default_rng(0)
    if name == "w1":
        lengths = rng.integers(32, 513, size=64).tolist()
        return Workload("w1", _random_prompts(rng, lengths), 128)
    if name == "w2":
        return Workload("w2", _random_prompts(rng, [32] * 8), 512)
    if name == "w3":
        return Workload("w3", _random_prompts(rng, [32]), 256)
    raise ValueError(f"unknown workload {name!r}; expected w1, w2 or w3")


WORKLOADS = ("w1", "w2", "w3")


def result(runner: str, w: Any, walls: list[float], ttfts: list[float], output_tokens: int,
           **extra: Any) -> dict[str, Any]:
    """A run's `RESULT` fields for workload `w` (every runner's, polyrunner's and the foreign
    workers'): the median of the timed runs' `walls`, output and total tok/s; W2's mean time per
    output token (wall / max_tokens); W3's TTFT (median of `ttfts`, the 1-token runs or the first
    tokens' times) and time per output token ((wall - TTFT) / (max_tokens - 1))."""
    wall = statistics.median(walls)
    res = dict(runner=runner, workload=w.name, wall_s=wall, walls=walls, output_tokens=output_tokens,
               prompt_tokens=w.prompt_tokens, output_tok_s=output_tokens / wall,
               total_tok_s=(output_tokens + w.prompt_tokens) / wall, **extra)
    if w.name == "w2":
        res["tpot_ms"] = wall / w.max_tokens * 1e3
    if w.name == "w3":
        ttft = statistics.median(ttfts)
        res["ttft_ms"] = ttft * 1e3
        res["tpot_ms"] = (wall - ttft) / (w.max_tokens - 1) * 1e3
    return res
