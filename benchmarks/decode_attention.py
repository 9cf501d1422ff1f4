"""The CPU decode attention kernel alone (`pr_paged_attention`, backends/cpu/paged_attention.cpp) in
float32, the native build (its SIMD paths: the AVX2 + FMA float32 decode, `decode_block_f32`) against
the portable build (the plain loops, -DPR_PORTABLE), at real models' head shapes.

    .venv/bin/python benchmarks/decode_attention.py [--rounds 3] [--calls 20] [--threads 2]

Per case (requests x context, heads / KV heads x head size; one query per request, block size 16,
each request's blocks in random order, one cache per layer for `LAYERS` layers so a step's keys and
values come from memory as a model's do): microseconds per layer, run as a decode step runs (the
kernels' pool started, torch's OpenMP on one thread). Each round times both builds, taking turns;
the figure is the median of the rounds, with the ratio portable / native and the largest output
difference between the builds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from polyrunner.backends.cpu import kernels
from polyrunner.tools.bench.host import format_host, host_info

LAYERS = 8
# (requests, context, query heads, KV heads, head size): SmolLM2-1.7B (32/32 x 64) at W3's and W2's
# sizes, Llama-3-8B's GQA (32/8 x 128)
CASES = [(1, 96, 32, 32, 64), (1, 288, 32, 32, 64), (8, 288, 32, 32, 64), (1, 1024, 32, 8, 128),
         (8, 512, 32, 8, 128)]


def layer_call(lib, R: int, L: int, Hq: int, Hkv: int, D: int, bs: int = 16):
    """A function running the kernel once per layer, and the output of the last."""
    g = torch.Generator().manual_seed(0)
    nb = -(-L // bs)
    caches = [torch.randn(2, R * nb + 1, bs, Hkv, D, generator=g) for _ in range(LAYERS)]
    table = (torch.randperm(R * nb, generator=g) + 1).to(torch.int32).reshape(R, nb)
    q, out = torch.randn(R, Hq, D, generator=g), torch.empty(R, Hq, D)
    qsl, lens = torch.arange(R + 1, dtype=torch.int32), torch.full((R,), L, dtype=torch.int32)

    def run() -> None:
        for cache in caches:
            rc = lib.pr_paged_attention(0, q.data_ptr(), q.stride(0), q.data_ptr(), q.stride(0), q.data_ptr(),
                                        q.stride(0), cache.data_ptr(), R * nb + 1, bs, Hq, Hkv, D, qsl.data_ptr(), 0,
                                        qsl.data_ptr(), lens.data_ptr(), table.data_ptr(), table.stride(0),
                                        out.data_ptr(), out.stride(0), 0, R, D ** -0.5, 0, 0.0)
            if rc:
                raise RuntimeError(f"pr_paged_attention failed ({rc})")
    return run, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20, help="steps per timing (each: every layer once)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(format_host(host_info()))
    libs = {name: kernels.load_library(name) for name in ("native", "portable")}
    if any(lib is None for lib in libs.values()):
        raise SystemExit("no C++ compiler: the kernel library is not built")
    print(f"native build's float32 AVX2 decode path: {'yes' if kernels.simd_f32(libs['native']) else 'no'}")
    torch.set_num_threads(1)
    for lib in libs.values():
        lib.pr_pool_start(args.threads, None, 0, 200)
    print(f"{'case':34s} {'native us/layer':>16s} {'portable us/layer':>18s} {'portable/native':>16s} {'max diff':>9s}")
    for R, L, Hq, Hkv, D in CASES:
        calls = {name: layer_call(lib, R, L, Hq, Hkv, D) for name, lib in libs.items()}
        times: dict[str, list[float]] = {name: [] for name in libs}
        for _ in range(args.rounds):
            for name, (run, _) in calls.items():
                run()
                t = time.perf_counter()
                for _ in range(args.calls):
                    run()
                times[name].append((time.perf_counter() - t) / args.calls / LAYERS * 1e6)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        diff = float((calls["native"][1] - calls["portable"][1]).abs().max())
        case = f"{R} requests x {L} keys, {Hq}/{Hkv} x {D}"
        print(f"{case:34s} {med['native']:16.1f} {med['portable']:18.1f} {med['portable'] / med['native']:15.2f}x "
              f"{diff:9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
