"""Run one benchmark workload on vLLM's CPU engine; prints one JSON line.

Runs inside the vLLM venv (see benchmarks/compare.py, which sets it up and
calls this file); loads the workload definitions by path so both runners get
exactly the same requests.

    python benchmarks/vllm_workload.py --model FOLDER --workload w1 [--eager] [--repeats 3] [--max-tokens N]

A `LOAD {json}` line gives the start-up (the `LLM(...)` call) and the resident memory of this
process and its children (the engine core) after it and at its peak (benchmarks/proc_stats.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from proc_stats import LoadMeter, end_stats
from shared_workloads import capped, result, workloads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", nargs="+", default=["w1", "w2", "w3"])
    p.add_argument("--eager", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="as polyrunner's dtype auto resolved (compare.py passes it)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every workload's output tokens (smoke runs)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's (4096 on CPU)")
    args = p.parse_args()
    n = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    wl = workloads()
    t0 = time.perf_counter()
    with LoadMeter() as meter:
        extra = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
        llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=args.eager, seed=0,
                  max_model_len=args.max_model_len, max_num_seqs=64, enable_prefix_caching=False, **extra)
    load_s = time.perf_counter() - t0
    print("LOAD " + json.dumps(meter.stats()), flush=True)

    def run(prompts, max_tokens):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - start
        return wall, sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].token_ids for o in outs]

    run([[5, 6, 7, 8]], 8)  # warm-up
    for name in args.workload:
        w = capped(wl.make_workload(name), args.max_tokens)
        run(w.prompts[:4], 8)
        walls, ttfts, ntok, tokens = [], [], 0, []
        for _ in range(args.repeats):
            if name == "w3":
                ttfts.append(run(w.prompts, 1)[0])
            wall, ntok, tokens = run(w.prompts, w.max_tokens)
            walls.append(wall)
        res = result("vllm-" + ("eager" if args.eager else "compiled"), w, walls, ttfts, ntok, load_s=load_s,
                     first_tokens=tokens[0][:16], **end_stats())
        print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
