"""The CPU "lora" kernel alone (`pr_lora`, backends/cpu/lora_kernel.cpp) per linear of SmolLM2-135M.

    .venv/bin/python benchmarks/lora_kernel.py [--dtype bfloat16|float32] [--iters 20] [--layers 30]
                                               [--variant native|portable]

For each of the model's four LoRA linears (qkv_proj, o_proj, gate_up_proj, down_proj; rank 16, 8
slots of random adapters; `--layers` copies of each, called in turn as a step calls its layers, so
the weights come from memory, not a cache that one layer's fit in) at 1 and 32 rows: the time of
one `pr_lora` call (through ctypes, as an eager step makes it; the cost of an empty ctypes call
is printed to subtract) with 0 slots used (every token -1), 1 slot for all tokens and 8 slots
mixed (token t in slot t % 8), and its ratio to the base linear's time at that row count
(bfloat16: the `PackedLinear` the engine plans; float32: torch's). Run as a decode step runs: the
kernels' thread pool started, torch's OpenMP on one thread.
The median of 5 runs of `--iters` passes over the layers each.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from polyrunner.backends.cpu import kernels, threads
from polyrunner.backends.cpu.lora_module import CPULoRALinear, LoRAOverride
from polyrunner.ops.lora import LoRALinear, LoRAMapping

HIDDEN, INTER, RANK, SLOTS = 576, 1536, 16, 8
LINEARS = {"qkv_proj": (HIDDEN, (576, 192, 192)), "o_proj": (HIDDEN, (HIDDEN,)),
           "gate_up_proj": (HIDDEN, (INTER, INTER)), "down_proj": (INTER, (HIDDEN,))}


def timed(fn: Callable[[], object], iters: int) -> float:
    """Median microseconds per call of `fn` over 5 runs of `iters` calls (after a warm-up)."""
    for _ in range(max(2, iters // 10)):
        fn()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(runs)


_PACKERS: dict[str, nn.Module] = {}


def base_linear(inp: int, out: int, dtype: torch.dtype) -> nn.Module:
    """The base: bfloat16 packed as the engine does (one planner: each shape timed once), else torch's."""
    linear = nn.Linear(inp, out, bias=False).to(dtype).requires_grad_(False)
    if dtype != torch.bfloat16:
        return linear
    from polyrunner.backends.cpu.op_overrides import LinearPacker
    packer = _PACKERS.setdefault("bf16", LinearPacker(64))
    return packer(linear)


def in_turn(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One call of each of `fns`, in order (a step's layers)."""
    return lambda: [fn() for fn in fns]


def kernel_call(module: CPULoRALinear, x: torch.Tensor, y: torch.Tensor) -> Callable[[], object]:
    """The module's `pr_lora` call with its arguments bound (y updated in place)."""
    args = (kernels.DTYPES[x.dtype], x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
            module.mapping.token_lora.data_ptr(), module.lora_a.data_ptr(), module.lora_b.data_ptr(),
            module.bounds.data_ptr(), x.shape[0], module.in_features, module.out_features, module.max_loras,
            len(module.output_slices), module.max_rank, module.scratch.data_ptr(), module.chunk)
    fn = module.lib.pr_lora
    return lambda: fn(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--iters", type=int, default=20, help="timed passes over the layers")
    parser.add_argument("--layers", type=int, default=30, help="copies of each linear (SmolLM2-135M: 30)")
    parser.add_argument("--variant", choices=["native", "portable"], default="native")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    count = threads.start_pool()
    torch.set_num_threads(1)
    with kernels.use_kernels(args.variant) as lib:
        assert lib is not None, "no CPU kernel library"
        empty = timed(lib.pr_lora_simd, 3000)
        print(f"# pr_lora ({args.variant}, simd={lib.pr_lora_simd()}), {args.dtype}, rank {RANK}, {SLOTS} slots, "
              f"{count} pool threads; an empty ctypes call: {empty:.1f} us")
        print(f"{'linear':>13} {'rows':>4} {'base us':>8} | {'0 slots':>14} {'1 slot':>14} {'8 slots':>14}")
        gen = torch.Generator().manual_seed(0)
        for name, (inp, slices) in LINEARS.items():
            layers = [make_layer(inp, slices, dtype, gen) for _ in range(args.layers)]
            for rows in (1, 32):
                x = torch.randn(rows, inp, generator=gen).to(dtype)
                y = torch.zeros(rows, sum(slices), dtype=dtype)
                base_us = timed(in_turn([functools.partial(base, x) for base, _ in layers]), args.iters) / args.layers
                cells = []
                for slots in (torch.full((rows,), -1), torch.zeros(rows), torch.arange(rows) % SLOTS):
                    for _, module in layers:
                        module.mapping.set(slots.to(torch.int32))
                    us = timed(in_turn([kernel_call(module, x, y) for _, module in layers]), args.iters) / args.layers
                    cells.append(f"{us:7.1f} ({us / base_us:4.2f}x)")
                print(f"{name:>13} {rows:>4} {base_us:8.1f} | " + " ".join(f"{c:>14}" for c in cells))


def make_layer(inp: int, slices: tuple[int, ...], dtype: torch.dtype,
               gen: torch.Generator) -> tuple[nn.Module, CPULoRALinear]:
    """A base linear and its `CPULoRALinear` over SLOTS random adapters (B block diagonal)."""
    base = base_linear(inp, sum(slices), dtype)
    lora = LoRALinear(base, inp, slices, SLOTS, RANK, LoRAMapping(64), dtype, "cpu")
    lora.lora_a.data.copy_(torch.randn(lora.lora_a.shape, generator=gen) * inp ** -0.5)
    blocks = torch.block_diag(*[torch.ones(width, RANK) for width in slices])
    lora.lora_b.data.copy_(torch.randn(lora.lora_b.shape, generator=gen) * 0.02 * blocks)
    module = LoRAOverride(64)(lora)
    assert isinstance(module, CPULoRALinear)
    return base, module

if __name__ == "__main__":
    main()
