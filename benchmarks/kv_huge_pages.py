"""Decode attention over a KV cache on 4 KiB pages against one on transparent huge pages.

    .venv/bin/python benchmarks/kv_huge_pages.py [--cache-gib 2] [--repeats 5]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head dim 64, bfloat16, blocks of 16):
one decode step of `--requests` requests with contexts U[33, 640) over 30 layers, each request's
blocks drawn at random from a cache of `--cache-gib` GiB (what a long-running server's block pool
looks like after prefix caching and frees have shuffled it). Two caches of that size are allocated,
one advised with `host_memory.advise_huge_pages` before its first touch; the two take turns within
each repeat and the fastest step of each counts. Prints ms per step and the KV bytes read per second,
with the CPU flags and the kernel's transparent-huge-page mode.
"""

from __future__ import annotations

import argparse
import time

import torch

from polyrunner.backends.cpu import host_memory, kernels
from polyrunner.tools.bench.host import format_host, host_info

HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30


def make_cache(num_blocks: int, huge: bool) -> list[torch.Tensor]:
    caches = []
    for _ in range(LAYERS):
        cache = torch.empty(2, num_blocks, BS, HKV, D, dtype=torch.bfloat16)
        if huge:
            host_memory.advise_huge_pages(cache)
        caches.append(cache.normal_())
    return caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-gib", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if kernels.paged_attention_kernel() is None:
        raise SystemExit("the CPU attention kernel did not build here")
    kernels.start_pool(torch.get_num_threads())
    gen = torch.Generator().manual_seed(0)
    R = args.requests
    num_blocks = int(args.cache_gib * 2**30 / (LAYERS * 2 * BS * HKV * D * 2))
    lens = torch.randint(33, 640, (R,), dtype=torch.int32, generator=gen)
    per_req = (lens + BS - 1) // BS
    if int(per_req.sum()) >= num_blocks:
        raise SystemExit(f"--cache-gib {args.cache_gib} holds {num_blocks} blocks, the requests need more")
    picks = torch.randperm(num_blocks - 1, generator=gen)[: int(per_req.sum())] + 1
    table = torch.zeros(R, int(per_req.max()), dtype=torch.int32)
    for r, row in enumerate(torch.split(picks, per_req.tolist())):
        table[r, : len(row)] = row
    q = torch.randn(R, HQ, D, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    qsl = torch.arange(R + 1, dtype=torch.int32)
    caches = {"4 KiB pages": make_cache(num_blocks, False), "huge pages": make_cache(num_blocks, True)}

    def step(layers: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for cache in layers:
            kernels.call_kernel(q, q, q, cache, qsl, 0, qsl, lens, table, out, 0, R, D ** -0.5, 0)
        return time.perf_counter() - start

    best = dict.fromkeys(caches, float("inf"))
    for rep in range(args.repeats + 1):
        for name, layers in caches.items():
            t = step(layers)
            if rep:
                best[name] = min(best[name], t)
    mode = host_memory.thp_mode() or "not in this kernel"
    print(format_host(host_info()))
    print(f"transparent huge pages: {mode}; {R} requests, mean context {float(lens.float().mean()):.0f} keys, "
          f"{LAYERS} layers, cache {args.cache_gib} GiB ({num_blocks} blocks per layer)")
    read = float(lens.sum()) * HKV * D * 2 * 2 * LAYERS
    for name, t in best.items():
        print(f"  {name:12} {t * 1e3:7.2f} ms per step  {read / t / 1e9:5.1f} GB/s of KV")
    print(f"  huge pages: {best['4 KiB pages'] / best['huge pages']:.2f}x")


if __name__ == "__main__":
    main()
