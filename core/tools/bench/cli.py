"""`polyrunner bench`: the performance workloads on the CPU backend.

    polyrunner bench --workload w1|w2|w3|coldstart|overhead|roofline|kernels|all [--repeats 3] [--json FILE]

w1-w3 run SmolLM2-135M-Instruct (the embedded default) in dtype "auto" (bfloat16
on a CPU with AVX512_BF16 or AMX, else float32), greedy,
ignore_eos, prefix caching off (so repeats do not reuse each other's prompts);
`roofline` measures the bf16 matmul rate at the model's shapes and, when run
with workloads, the fraction of it each workload achieved. Compare against
other runners with `benchmarks/compare.py`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

WORKLOAD_CHOICES = ["w1", "w2", "w3", "coldstart", "overhead", "roofline", "kernels", "all"]


# the engine options a benchmark may change (the others are fixed so runs compare; see run.ENGINE_OPTIONS)
BENCH_ENGINE_ARGS = {"dtype", "quantization", "enforce_eager"}


def add_parser(subparsers) -> None:
    from polyrunner.tools.engine_args import HelpFormatter, add_engine_args
    p = subparsers.add_parser("bench", help="run the performance benchmarks (CPU backend)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--workload", nargs="+", default=["all"], choices=WORKLOAD_CHOICES,
                   help="workloads to run (w1-w3: generation; coldstart: time to the first token of a new "
                        "process; overhead: host time per step; roofline: matmul rate; kernels: the kernel "
                        "the backend chose per weight shape and row count, with its measurements; all: every one)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per workload (median reported)")
    add_engine_args(p, only=BENCH_ENGINE_ARGS)
    p.add_argument("--overhead-steps", type=int, default=200, help="engine steps timed by the overhead workload")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=cmd_bench)


def _expand(names: list[str]) -> list[str]:
    if "all" in names:
        return ["w1", "w2", "w3", "coldstart", "overhead", "roofline", "kernels"]
    return list(dict.fromkeys(names))


def run_bench(names: list[str], repeats: int = 3, model: str | None = None, enforce_eager: bool = False,
              overhead_steps: int = 200, **options) -> dict[str, Any]:
    from polyrunner.tools.bench import roofline
    from polyrunner.tools.bench.run import cold_start, kernel_report, run_all_workloads
    from polyrunner.tools.bench.workloads import make_workload
    names = _expand(names)
    from polyrunner.tools.bench.host import host_info
    out: dict[str, Any] = {"host": host_info(), "load_avg_start": os.getloadavg()}
    gen = [n for n in names if n in ("w1", "w2", "w3")]
    if gen:
        out["workloads"] = run_all_workloads(gen, repeats, model, enforce_eager, **options)
    if "kernels" in names:
        out["kernels"] = kernel_report(model, enforce_eager, **options)
    if "coldstart" in names:
        out["coldstart"] = cold_start(repeats)
    if "overhead" in names:
        from polyrunner.tools.bench.overhead import run_overhead
        out["overhead_us"] = run_overhead(steps=overhead_steps, repeats=repeats)
    if "roofline" in names:
        shape = roofline.ModelShape()
        rates = roofline.matmul_rates(shape)
        peak = max(rates.values())
        out["roofline"] = {"rates_gflops": {T: r / 1e9 for T, r in rates.items()}, "peak_gflops": peak / 1e9}
        for res in out.get("workloads", []):
            w = make_workload(res["workload"])
            flops = roofline.workload_flops(shape, [len(p) for p in w.prompts], w.max_tokens)
            res["model_gflop"] = flops["total"] / 1e9
            res["achieved_gflops"] = flops["total"] / res["wall_s"] / 1e9
            res["roofline_fraction"] = flops["total"] / res["wall_s"] / peak
            bound = roofline.shape_aware_time(rates, res.get("step_tokens", []), shape)
            res["shape_aware_bound_s"] = bound
            res["shape_aware_fraction"] = bound / res["wall_s"]
    out["load_avg_end"] = os.getloadavg()
    return out


def format_report(out: dict[str, Any]) -> str:
    from polyrunner.tools.bench.host import format_host
    lines = [format_host(out["host"])] if "host" in out else []
    for res in out.get("workloads", []):
        parts = [f"{res['workload']}: wall {res['wall_s']:.2f} s", f"out {res['output_tok_s']:.1f} tok/s",
                 f"total {res['total_tok_s']:.1f} tok/s"]
        if "ttft_ms" in res:
            parts.append(f"TTFT {res['ttft_ms']:.1f} ms")
        if "tpot_ms" in res:
            parts.append(f"TPOT {res['tpot_ms']:.1f} ms")
        if "roofline_fraction" in res:
            parts.append(f"{res['achieved_gflops']:.0f} GFLOP/s = {100 * res['roofline_fraction']:.1f}% of peak "
                         f"({100 * res['shape_aware_fraction']:.1f}% of the shape-aware bound)")
        lines.append(", ".join(parts))
    if "coldstart" in out:
        c = out["coldstart"]
        lines.append(f"cold start: {c['cold_start_s']:.2f} s to the first token "
                     f"(runs: {', '.join(f'{r:.2f}' for r in c['runs'])})")
    if "kernels" in out:
        lines.append("kernels chosen (per weight shape and row count):\n" + out["kernels"])
    if "overhead_us" in out:
        lines.append("host overhead: " + ", ".join(f"{n} req {us:.0f} us/step" for n, us in out["overhead_us"].items()))
    if "roofline" in out:
        r = out["roofline"]
        lines.append("bf16 matmul rate at the model's shapes: " + ", ".join(
            f"T={T} {g:.0f}" for T, g in r["rates_gflops"].items()) + f" GFLOP/s (peak {r['peak_gflops']:.0f})")
    lines.append("load average (1, 5, 15 min) at start {} / end {}".format(
        *[", ".join(f"{x:.1f}" for x in out[k]) for k in ("load_avg_start", "load_avg_end")]))
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from polyrunner.tools.engine_args import engine_kwargs
    options = engine_kwargs(args)
    model, enforce_eager = options.pop("model"), options.pop("enforce_eager")
    out = run_bench(args.workload, args.repeats, model, enforce_eager, args.overhead_steps, **options)
    print(format_report(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0
