"""One-shot check of the CUDA backend on a GPU machine (no network needed).

    python benchmarks/cuda_check.py            # tests + benchmark, one summary
    python benchmarks/cuda_check.py --skip-tests --backend cpu   # dry run without a GPU

1. runs `pytest tests/test_cuda_backend.py` (the GPU-only tests run when a GPU is visible);
   then the conformance suite against the backend (`polyrunner.tools.conformance`), when present;
2. writes a small random Llama (config.json + safetensors) to a temp folder;
3. greedy generation with CUDA graphs and with `enforce_eager`, for a batch-1
   and a batched workload: tokens/s, graph count, capture time and memory,
   and whether graphs and eager produced the same tokens;
4. prints one summary (human lines, then one JSON line).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def run_tests() -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_cuda_backend.py", "-q", "-rs",
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    failures = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    return {"rc": proc.returncode, "result": lines[-1] if lines else proc.stderr[-500:],
            "failures": failures[:20], "skipped": [ln for ln in lines if ln.startswith("SKIPPED")][:10],
            "seconds": round(time.perf_counter() - t0, 1),
            "tail": "\n".join(lines[-40:]) if proc.returncode else ""}


def run_conformance_suite(backend: str) -> dict:
    try:
        from polyrunner.tools.conformance.framework import run_conformance
    except ImportError as exc:
        return {"result": f"not available: {exc}"}
    t0 = time.perf_counter()
    report = run_conformance(backend)
    counts: dict[str, int] = {}
    for r in report.results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return {"result": ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
            "failures": [f"{r.group}::{r.name}: {str(r.detail)[:300]}" for r in report.failures()],
            "seconds": round(time.perf_counter() - t0, 1)}


def bench(folder: Path, backend: str, eager: bool, workloads: dict, args) -> dict:
    import torch
    from polyrunner import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(folder), backend=backend, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_mib << 20,
              enforce_eager=eager)
    init_s = time.perf_counter() - t0
    ex = llm.engine.runner.executor
    out = {"init_s": round(init_s, 2), "num_graphs": ex.num_graphs(),
           "capture_s": round(getattr(ex, "capture_seconds", 0.0), 3),
           "capture_mib": round(getattr(ex, "capture_bytes", 0) / 2**20, 1),
           "disabled_reason": getattr(ex, "disabled_reason", None), "dtype": str(llm.engine.dtype)}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(workloads["batch"][:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up: allocator, kernels, autotuning
    tokens = {}
    for name, prompts in workloads.items():
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens[name] = [r.outputs[0].token_ids for r in res]
        n = sum(len(t) for t in tokens[name])
        out[f"{name}_tok_s"] = round(n / dt, 1)
        out[f"{name}_s"] = round(dt, 3)
    out["graphs_after_run"] = ex.num_graphs()
    del llm, ex
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-conformance", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-mib", type=int, default=1024)
    args = p.parse_args()

    summary: dict = {}
    if not args.skip_tests:
        summary["tests"] = run_tests()

    import numpy as np
    from polyrunner.plugins import list_backends
    from test_cuda_backend import write_tiny_llama

    info = {i.name: i for i in list_backends()}.get(args.backend)
    if info is None or not info.availability.available:
        reason = "unknown backend" if info is None else info.availability.reason
        summary["benchmark"] = f"skipped: backend {args.backend!r} unavailable: {reason}"
    else:
        summary["device"] = info.availability.device
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(3, args.vocab, size=args.prompt_len).tolist()}
                   for _ in range(args.batch)]
        workloads = {"bs1": prompts[:1], "batch": prompts}
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_tiny_llama(Path(tmp) / "llama", vocab=args.vocab, hidden=args.hidden,
                                      inter=3 * args.hidden, layers=args.layers, heads=8, kv_heads=2,
                                      max_pos=max(2048, args.prompt_len + args.max_tokens))
            graphs, g_tokens = bench(folder, args.backend, False, workloads, args)
            eager, e_tokens = bench(folder, args.backend, True, workloads, args)
        same = sum(a == b for name in workloads for a, b in zip(g_tokens[name], e_tokens[name]))
        total = sum(len(w) for w in workloads.values())
        summary["benchmark"] = {
            "model": f"llama hidden={args.hidden} layers={args.layers} heads=8/2 vocab={args.vocab}",
            "graphs": graphs, "eager": eager,
            "speedup_bs1": round(graphs["bs1_tok_s"] / eager["bs1_tok_s"], 2),
            "speedup_batch": round(graphs["batch_tok_s"] / eager["batch_tok_s"], 2),
            "greedy_equal_graphs_vs_eager": f"{same}/{total}"}
        if not args.skip_conformance:  # after the benchmark: it builds many engines
            summary["conformance"] = run_conformance_suite(args.backend)

    print("=" * 72)
    print("polyrunner CUDA check")
    if "tests" in summary:
        t = summary["tests"]
        print(f"tests: {t['result']} (rc={t['rc']}, {t['seconds']}s)")
        for line in t["failures"]:
            print("  " + line)
        if t["tail"]:
            print(t["tail"])
    if "conformance" in summary:
        c = summary["conformance"]
        print(f"conformance: {c['result']}" + (f" ({c['seconds']}s)" if "seconds" in c else ""))
        for line in c.get("failures", []):
            print("  " + line)
    b = summary["benchmark"]
    if isinstance(b, str):
        print(b)
    else:
        print(f"device: {summary['device']}  model: {b['model']}")
        for mode in ("graphs", "eager"):
            r = b[mode]
            print(f"{mode:>6}: bs1 {r['bs1_tok_s']:>9} tok/s | batch {r['batch_tok_s']:>9} tok/s | "
                  f"graphs {r['num_graphs']} (after run {r['graphs_after_run']}) | capture {r['capture_s']}s "
                  f"{r['capture_mib']} MiB | init {r['init_s']}s | {r['dtype']}"
                  + (f" | disabled: {r['disabled_reason']}" if r["disabled_reason"] else ""))
        print(f"speedup: bs1 x{b['speedup_bs1']}  batch x{b['speedup_batch']}  "
              f"greedy equal: {b['greedy_equal_graphs_vs_eager']}")
    print("SUMMARY " + json.dumps(summary, default=str))
    bad_tests = summary.get("tests", {}).get("rc", 0) not in (0, 5)
    return 1 if bad_tests or summary.get("conformance", {}).get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
