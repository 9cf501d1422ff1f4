"""Where the pool's bfloat16 linears prefetch the weights they stream: into L1 or L2, by measurement.

`linear_bf16.cpp` (AVX512_BF16) and `linear_avx512.cpp` (AVX-512F) fetch every line of the
weights a fixed distance ahead of the dot products (`weight_prefetch.h`). On a Zen 4 VM, into L2
made 8-row decode steps ~5% faster than into L1 (benchmarks/results/design-measurements.md); the
kernels were first tuned with L1 on an Intel Xeon. `choose` therefore times both once per machine
(`prefetch_level.py`) on passes over weights beyond the caches, with the kernel that runs decode
steps here, at 1 and 8 rows, and sets the faster; `POLYRUNNER_CPU_LINEAR_PREFETCH=l1|l2` forces
one. The linears' kernel table is timed at the level set (`kernel_table.shape_key`).
"""

from __future__ import annotations

import torch

from polyrunner.backends.cpu import envs, kernel_table, kernels, prefetch_level

LEVELS = prefetch_level.LEVELS
N, K, LAYERS = 2048, 1024, 20   # 4 MB of weights a layer, 80 MB a pass: beyond the caches (40 MB was not)
ROWS = (1, 8)


def choose(threads: int) -> str:
    """Set the level the pool's bfloat16 linears prefetch to, and return a line saying which and
    why: forced, timed (once per machine: then read from the kernel table), or nothing to choose
    (no pool linear here: "l1")."""
    kernel = next((k for k in ("dpbf16", "avx512") if k in kernel_table.available()), None)
    return prefetch_level.choose(
        "the pool's bfloat16 linears prefetch their weights",
        (envs.LINEAR_PREFETCH.get(), "POLYRUNNER_CPU_LINEAR_PREFETCH"),
        None if kernel is not None else "no AVX-512 linear here",
        f"linear prefetch {kernel}", lambda: _time(str(kernel)), threads, kernels.set_linear_prefetch,
        f"per pass over {LAYERS} x {N} x {K} weights at {' and '.join(map(str, ROWS))} rows")


def _time(kernel: str) -> kernel_table.Times:
    """us per pass over `LAYERS` layers at each of `ROWS` rows with each level, the two taking turns."""
    g = torch.Generator().manual_seed(0)
    packed = [kernel_table.pack(kernel, torch.empty(N, K, dtype=torch.bfloat16).normal_(generator=g), 1)
              for _ in range(LAYERS)]
    run = kernel_table.runner(kernel)
    xs = {M: torch.empty(M, K, dtype=torch.bfloat16).normal_(generator=g) for M in ROWS}

    def step(l2: bool, M: int):
        def call() -> None:
            kernels.set_linear_prefetch(l2)
            for p in packed:
                run(xs[M], p, N, None)
        return call
    best = kernel_table.time_in_turns({f"{name} {M}": step(name == "l2", M) for name in LEVELS for M in ROWS})
    return {name: {M: best[f"{name} {M}"] for M in ROWS} for name in LEVELS}
