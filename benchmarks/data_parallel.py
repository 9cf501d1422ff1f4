"""Data parallelism on one host: offline throughput of W1 (64 requests, prompts
U[32, 512], 128 tokens out; `polyrunner.tools.bench.workloads`) at
data_parallel_size 1 and 2 in one run, plus the router's cost per request.

    .venv/bin/python benchmarks/data_parallel.py [--requests 64] [--max-tokens 128] [--model PATH] [--out FILE]

The model is the embedded SmolLM2 (`LLM(None)`), as in compare.py, in the dtype
"auto" resolves to. dp=1 is `LLM`'s engine in this process; with dp=2 each
replica is an engine process on half of the physical cores (`replica_share`), so
on a 2-core host the two replicas do the same work on the same cores as one
engine with both — expect roughly equal throughput there; dp pays off when one
engine cannot use the whole host (memory-bound decode on many cores, or one
accelerator per replica). The routing overhead is the mean time of `Router.choose`
over many calls (least_loaded and cache_aware, 2 and 8 replicas).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

from polyrunner import LLM, SamplingParams
from polyrunner.engine.dp_router import Router
from polyrunner.tools.bench.workloads import make_workload


def run(dp: int, model: str | None, requests: int, max_tokens: int) -> dict:
    wl = make_workload("w1")
    prompts = [{"prompt_token_ids": p} for p in wl.prompts[:requests]]
    llm = LLM(model, backend="cpu", data_parallel_size=dp, enable_prefix_caching=False, max_num_seqs=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:2 * dp], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)   # warm up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"dp": dp, "requests": len(prompts), "seconds": round(elapsed, 3),
            "output_tok_per_s": round(generated / elapsed, 1),
            "total_tok_per_s": round((generated + sum(len(p["prompt_token_ids"]) for p in prompts)) / elapsed, 1)}


def routing_overhead(calls: int = 200_000) -> dict[str, float]:
    """Mean microseconds per `Router.choose` call."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(49152) for _ in range(rng.randrange(32, 513))]}
               for _ in range(256)]
    result = {}
    for routing in ("least_loaded", "cache_aware"):
        for replicas in (2, 8):
            router = Router(routing)
            loads = [rng.randrange(64) for _ in range(replicas)]
            alive = [True] * replicas
            t0 = time.perf_counter()
            for i in range(calls):
                loads[router.choose(loads, alive, prompts[i & 255])] += 1
            result[f"{routing}_dp{replicas}_us"] = round((time.perf_counter() - t0) / calls * 1e6, 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64, help="the first N requests of W1 (default: all 64)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens out per request (W1: 128)")
    ap.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2)")
    ap.add_argument("--routing-calls", type=int, default=200_000)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    rows = [run(dp, args.model, args.requests, args.max_tokens) for dp in (1, 2)]
    result = {"host": platform.node(), "rows": rows, "dp2_over_dp1": round(rows[1]["output_tok_per_s"]
                                                                           / rows[0]["output_tok_per_s"], 3),
              "routing_overhead": routing_overhead(args.routing_calls)}
    for row in rows:
        print(f"dp={row['dp']}: {row['requests']} requests in {row['seconds']} s, "
              f"{row['output_tok_per_s']} output tok/s, {row['total_tok_per_s']} total tok/s")
    print(f"dp=2 / dp=1 output throughput: {result['dp2_over_dp1']}")
    print("routing overhead per request (µs):", result["routing_overhead"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
