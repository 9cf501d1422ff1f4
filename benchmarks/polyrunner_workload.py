"""Run benchmark workloads on polyrunner in a fresh process: one round of `compare.py`'s interleaved
runs. Prints a `LOAD {json}` line (start-up: the `LLM(...)` call; resident memory after it and its
peak during it) and one `RESULT {json}` line per workload (as `polyrunner bench` measures it).

    .venv/bin/python benchmarks/polyrunner_workload.py --model PATH --workload w2 w3 [--dtype bfloat16]
                                                       [--repeats 1] [--max-tokens N] [--runner NAME]

PATH: a GGUF file (run quantized, as `LLM()` runs it by default, unless --dtype) or an HF folder.
The KV cache is mapped before the timed runs (`run.map_kv_cache`), as in `polyrunner bench`.
"""

from __future__ import annotations

import argparse
import json

from proc_stats import LoadMeter, end_stats
from shared_workloads import capped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded model)")
    p.add_argument("--workload", nargs="+", default=["w2", "w3"])
    p.add_argument("--dtype", default=None, help="default: the model's quantized weights as LLM() runs them")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=None, help="cap every workload's output tokens (smoke runs)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-bytes", type=int, default=None, help="kv_cache_memory_bytes (default: the backend's)")
    p.add_argument("--runner", default="polyrunner")
    args = p.parse_args()
    from polyrunner.tools.bench.run import make_llm, map_kv_cache, run_workload
    from polyrunner.tools.bench.workloads import make_workload
    options = {"prefault_kv_cache": True, "max_model_len": args.max_model_len}
    if args.dtype:
        options["dtype"] = args.dtype
    if args.kv_cache_bytes:
        options["kv_cache_memory_bytes"] = args.kv_cache_bytes
    with LoadMeter() as meter:
        llm = make_llm(args.model, **options)
    load = meter.stats()
    map_kv_cache(llm)
    load["dtype"] = str(llm.engine.dtype).removeprefix("torch.")
    print("LOAD " + json.dumps(load), flush=True)
    for name in args.workload:
        res = run_workload(llm, capped(make_workload(name), args.max_tokens), args.repeats)
        res["runner"] = args.runner
        res.update(end_stats())
        print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
