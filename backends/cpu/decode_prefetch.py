"""Where the bfloat16 decode attention prefetches the next KV block: into L1 or L2, by measurement.

`paged_attention.cpp`'s decode spreads prefetches of a request's next cache block over the
current block's compute (`NextBlock`). On a Zen 4 VM, L2 decoded 64 requests x 336 keys ~1.5x
faster (benchmarks/results/design-measurements.md), while the kernel was first tuned with L1 on an
Intel Xeon. `choose` therefore times both once per machine and head shape (`prefetch_level.py`) on
decode steps whose cache streams from memory, and sets the faster;
`POLYRUNNER_CPU_DECODE_PREFETCH=l1|l2` forces one.
"""

from __future__ import annotations

import torch

from polyrunner.backends.cpu import envs, kernel_table, kernels, prefetch_level
from polyrunner.plugin_api import LayerSpec, cdiv

LEVELS = prefetch_level.LEVELS
REQUESTS, CONTEXT, LAYERS = 32, 320, 8   # ~8 MB of keys and values per layer, 63 MB a step: beyond the caches


def choose(spec: LayerSpec, block_size: int, threads: int) -> str:
    """Set the level the decode attention prefetches to for layers like `spec`, and return a line
    saying which and why: forced, timed (once per machine: then read from the kernel table), or
    nothing to choose (no AVX512_BF16 decode kernel for this shape here: "l1")."""
    Hq, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_size
    unavailable = (None if kernels.simd_bf16() and D in (64, 128) and not Hq % Hkv
                   else "no AVX512_BF16 decode kernel for this shape here")
    return prefetch_level.choose(
        "decode attention prefetches", (envs.DECODE_PREFETCH.get(), "POLYRUNNER_CPU_DECODE_PREFETCH"), unavailable,
        f"decode prefetch {Hq}/{Hkv}x{D} block {block_size}", lambda: _time(Hq, Hkv, D, block_size), threads,
        kernels.set_decode_prefetch, f"per step of {REQUESTS} x {CONTEXT} keys")


def _time(Hq: int, Hkv: int, D: int, bs: int) -> kernel_table.Times:
    """us per decode step (`LAYERS` layers, `REQUESTS` requests of `CONTEXT` keys, blocks in random
    order) with each level, the two taking turns."""
    g = torch.Generator().manual_seed(0)
    nb = cdiv(CONTEXT, bs)
    caches = [torch.empty(2, REQUESTS * nb + 1, bs, Hkv, D, dtype=torch.bfloat16).normal_(generator=g)
              for _ in range(LAYERS)]
    table = (torch.randperm(REQUESTS * nb, generator=g) + 1).to(torch.int32).reshape(REQUESTS, nb)
    q = torch.empty(REQUESTS, Hq, D, dtype=torch.bfloat16).normal_(generator=g)
    out = torch.empty_like(q)
    qsl = torch.arange(REQUESTS + 1, dtype=torch.int32)
    lens = torch.full((REQUESTS,), CONTEXT, dtype=torch.int32)

    def step(l2: bool):
        def run() -> None:
            kernels.set_decode_prefetch(l2)
            for cache in caches:
                kernels.call_kernel(q, q, q, cache, qsl, 0, qsl, lens, table, out, 0, REQUESTS, D ** -0.5, 0)
        return run
    best = kernel_table.time_in_turns({name: step(name == "l2") for name in LEVELS})
    return {name: {REQUESTS: t} for name, t in best.items()}
