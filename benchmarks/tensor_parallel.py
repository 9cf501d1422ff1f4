"""Tensor parallelism on the CPU backend: W1 and W3 at tensor_parallel_size 1
and 2 in one run, and the time rank 0 spends in all-reduce per step.

    .venv/bin/python benchmarks/tensor_parallel.py [--workloads w1 w3] [--out FILE]

On a host with two cores each rank gets one core, so tensor_parallel_size=2
does the same work on the same cores plus the communication: a slowdown is
expected here; the figures show what the communication costs. Rank 0's
all-reduce time includes waiting for rank 1 to reach the same all-reduce.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from polyrunner import LLM, SamplingParams
from polyrunner.tools.bench.workloads import make_workload


class AllReduceTimer:
    """Wraps every all-reduce of rank 0's model and sums the time spent in it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds = 0.0
        self.calls = 0
        for module in [model, *model.modules()]:
            inner = getattr(module, "all_reduce", None)
            if callable(inner):
                module.all_reduce = self._timed(inner)

    def _timed(self, inner):
        def timed(x: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = inner(x)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            return out
        return timed


def run(tp: int, workload: str) -> dict:
    wl = make_workload(workload)
    # bfloat16 on both sizes (the GGUF dequantised): quantized execution has no tensor-parallel form yet
    llm = LLM(None, backend="cpu", dtype="bfloat16", tensor_parallel_size=tp, enable_prefix_caching=False,
              max_num_seqs=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=wl.max_tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in wl.prompts]
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)   # warm up
        runner = llm.engine.runner
        steps = [0]
        execute = runner.execute

        def counted(so):
            steps[0] += 1
            return execute(so)

        runner.execute = counted
        timer = AllReduceTimer(runner.model) if tp > 1 else None
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"workload": workload, "tp": tp, "wall_s": round(wall, 2), "output_tok_s": round(tokens / wall, 1),
           "steps": steps[0], "tokens": [o.outputs[0].token_ids[:8] for o in outs[:1]]}
    if timer is not None:
        row["all_reduce_ms_per_step"] = round(1000 * timer.seconds / max(steps[0], 1), 2)
        row["all_reduces_per_step"] = round(timer.calls / max(steps[0], 1), 1)
        row["all_reduce_share"] = round(timer.seconds / wall, 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["w1", "w3"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    flags = set(open("/proc/cpuinfo").read().split()) if platform.system() == "Linux" else set()
    cpu = {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")}
    rows = []
    for wl in args.workloads:
        for tp in (1, 2):
            rows.append(run(tp, wl))
            print(json.dumps(rows[-1]), flush=True)
    lines = ["workload  tp  output tok/s  wall s  steps  all-reduce ms/step  share of wall"]
    for r in rows:
        lines.append(f"{r['workload']:<8}  {r['tp']:>2}  {r['output_tok_s']:>12}  {r['wall_s']:>6}  {r['steps']:>5}  "
                     f"{r.get('all_reduce_ms_per_step', '-'):>18}  {r.get('all_reduce_share', '-'):>13}")
    for wl in args.workloads:
        one, two = (next(r for r in rows if r["workload"] == wl and r["tp"] == t) for t in (1, 2))
        same = "same" if one["tokens"] == two["tokens"] else "DIFFERENT"
        lines.append(f"{wl}: tp=2 / tp=1 output throughput {two['output_tok_s'] / one['output_tok_s']:.2f}x "
                     f"(first tokens {same})")
    lines.append(f"CPU flags: {', '.join(f'{k} {v}' for k, v in cpu.items())}; torch threads "
                 f"{torch.get_num_threads()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
