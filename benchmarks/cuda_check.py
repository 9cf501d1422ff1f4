"""One-shot check of the CUDA backend on a lent GPU (an H200 image: PyTorch, CUDA
and Triton preinstalled, no network). Runs from the repository root:

    python benchmarks/cuda_check.py [--model PATH.gguf|HF-folder] [--deadline 480]

First (`cuda_check_setup.py`) installs the wheels of `--wheels` (default `.whl`,
made here by `cuda_wheels.py`: pydantic and its dependencies, gguf) with pip
`--no-index --target`, makes polyrunner importable from this tree without
installing it, and checks every import up front (what is missing is named, with
the fix, and the GPU phases skip with that reason). Then it runs phases, each
under its own time limit and all under a global deadline (8 minutes by default),
and ALWAYS prints a summary and a final JSON line, whatever failed:

  setup       wheels installed, how polyrunner imports, modules missing
  env         versions, GPU, triton / attention op in use
  tests       pytest of the Triton, graph and CUDA-backend tests (GPU cases run)
  tiny        a tiny float32 Llama: greedy tokens of cuda (graphs) and cuda eager
              vs the CPU backend, first divergence; graph counters (replays,
              eager steps by reason)
  model       SmolLM2-135M (the embedded GGUF when found, else random weights of
              its shape): bfloat16 cuda vs float32 CPU greedy token-match rate
  decode      decode ms/token with graphs vs enforce_eager at batch 1 (target:
              graphs >= 5x eager), and at batch 64 with 2k contexts
  attention   the Triton decode kernel alone, batch x context grid; the batch-64
              2k cell as a fraction of the HBM-bandwidth floor (target >= 70%)
  memory      default settings (max_model_len of the model, gpu_memory_utilization
              0.9): a prompt of max_model_len - 16 tokens and a full batch, no OOM;
              KV budget, graph capture seconds / MiB vs the reserved estimate
  prefill     prefill tokens/s of one 2048-token prompt

Targets are in benchmarks/README.md (CUDA section).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from cuda_check_setup import prepare

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_SHAPE = dict(vocab=49152, hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, max_pos=8192)
HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}  # bytes/s, by name


class PhaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise PhaseTimeout in the main thread after `seconds` (between Python bytecodes)."""
    def fire(signum, frame):
        raise PhaseTimeout(f"phase exceeded {seconds:.0f}s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- set-up: cuda_check_setup.py -------------------------------------------------------
def write_llama(folder: Path, *, vocab=512, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, max_pos=2048,
                seed=0, std=0.08, dtype="float32") -> Path:
    """A random Llama checkpoint (config.json + safetensors): the conformance suite's writer."""
    from polyrunner.tools.conformance.tiny_llama import write_tiny_llama
    return write_tiny_llama(folder, seed=seed, std=std, dtype=dtype, vocab_size=vocab, hidden_size=hidden,
                            intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, max_position_embeddings=max_pos)


def cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def free() -> None:
    """Return cached GPU memory (callers drop their references first)."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[dict]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist()}
            for _ in range(n)]


def generate(llm, prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    import torch

    from polyrunner import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def first_divergence(a: list[list[int]], b: list[list[int]]) -> dict:
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return {"prompt": i, "token": j}
    return {}


# ---- phases -------------------------------------------------------------------------
def phase_env(args, ctx) -> dict:
    import torch
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        out["triton"] = f"missing: {exc}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out |= {"gpu": p.name, "gpu_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count}
    from polyrunner.plugins import list_backends
    info = {i.name: i for i in list_backends()}
    out["backend"] = {n: (i.availability.device or i.availability.reason) for n, i in info.items()
                      if n in ("cuda", "cpu")}
    if info.get("cuda") and info["cuda"].availability.available:
        from polyrunner.backends.cuda.plugin import load_attention
        op, adaptive = load_attention()
        out["attention_op"] = f"{op.__name__} (length_adaptive={adaptive})"
    return out


def phase_tests(args, ctx) -> dict:
    files = ["tests/test_triton_attention.py", "tests/test_triton_fused_ops.py", "tests/test_triton_moe.py",
             "tests/test_cuda_graphs.py",
             "tests/test_graph_modes.py", "tests/test_cuda_backend.py", "tests/test_pinned_staging.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-x", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, capture_output=True, text=True, timeout=ctx["limit"] - 5)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return {"rc": proc.returncode, "result": lines[-1] if lines else proc.stderr[-400:],
            "failures": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:10],
            "skipped": [ln[:200] for ln in lines if ln.startswith("SKIPPED")][:6],
            "tail": "\n".join(lines[-25:]) if proc.returncode else ""}


def phase_tiny(args, ctx) -> dict:
    from polyrunner import LLM
    folder = write_llama(Path(ctx["tmp"]) / "tiny")
    prompts = random_prompts(12, 4, 60, 512, seed=1)
    kw = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, block_size=16,
              kv_cache_memory_bytes=64 << 20)
    res, counters = {}, {}
    for name, backend, eager in (("cpu", "cpu", False), ("cuda_graphs", "cuda", False), ("cuda_eager", "cuda", True)):
        llm = LLM(str(folder), backend=backend, enforce_eager=eager, **kw)
        res[name], _ = generate(llm, prompts, 24)
        ex = llm.engine.runner.executor
        if hasattr(ex, "counters"):
            counters[name] = ex.counters()
        del llm, ex
        free()
    out = {f"{n}_vs_cpu": first_divergence(res["cpu"], res[n]) or "identical" for n in ("cuda_graphs", "cuda_eager")}
    out["graphs_vs_eager"] = first_divergence(res["cuda_eager"], res["cuda_graphs"]) or "identical"
    out["counters"] = counters.get("cuda_graphs")
    out["ok"] = out["graphs_vs_eager"] == "identical" and (counters.get("cuda_graphs") or {}).get("replays", 0) > 0
    return out


def model_source(args, ctx) -> tuple[str, str]:
    if args.model:
        return args.model, "given"
    try:
        from polyrunner.models.default_model import default_model_path
        return str(default_model_path()), "SmolLM2-135M-Instruct GGUF"
    except FileNotFoundError:
        folder = Path(ctx["tmp"]) / "smollm2-shape"
        if not folder.exists():
            write_llama(folder, **SMOLLM2_SHAPE, std=0.02, dtype="bfloat16")
        return str(folder), "random weights of SmolLM2-135M's shape (embedded GGUF not found)"


def phase_model(args, ctx) -> dict:
    from polyrunner import LLM
    path, what = model_source(args, ctx)
    prompts = random_prompts(6, 8, 40, 49000, seed=2)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory_bytes=512 << 20, max_model_len=1024)
    cpu = LLM(path, backend="cpu", dtype="float32", **kw)
    ref, _ = generate(cpu, prompts, 32)
    del cpu
    free()
    gpu = LLM(path, backend="cuda", dtype="bfloat16", **kw)
    got, _ = generate(gpu, prompts, 32)
    del gpu
    free()
    same = sum(u == v for x, y in zip(ref, got) for u, v in zip(x, y))
    prefix = [next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) for x, y in zip(ref, got)]
    return {"model": what, "token_match_rate": round(same / sum(map(len, ref)), 3),
            "mean_prefix_match": round(sum(prefix) / sum(map(len, ref)), 3), "first_divergence":
            first_divergence(ref, got) or "identical"}


def phase_decode(args, ctx) -> dict:
    from polyrunner import LLM
    path, what = model_source(args, ctx)
    out = {"model": what}
    for eager in (False, True):
        name = "eager" if eager else "graphs"
        llm = LLM(path, backend="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=8192,
                  max_model_len=4096, kv_cache_memory_bytes=8 << 30, enforce_eager=eager)
        one = random_prompts(1, 32, 32, 49000, seed=3)
        generate(llm, one, 8)  # warm-up
        _, t1 = generate(llm, one, 1)
        _, tn = generate(llm, one, 129)
        out[f"b1_ms_per_token_{name}"] = round((tn - t1) / 128 * 1e3, 3)
        batch = random_prompts(64, 2048, 2048, 49000, seed=4)
        _, p1 = generate(llm, batch, 1)
        _, pn = generate(llm, batch, 33)
        out[f"b64_ctx2k_ms_per_step_{name}"] = round((pn - p1) / 32 * 1e3, 3)
        if not eager:
            ex = llm.engine.runner.executor
            out["counters"] = ex.counters()
            out["capture_s"], out["capture_mib"] = round(ex.capture_seconds, 2), round(ex.capture_bytes / 2**20, 1)
            del ex
        del llm
        free()
    out["b1_graphs_speedup"] = round(out["b1_ms_per_token_eager"] / out["b1_ms_per_token_graphs"], 2)
    out["target_b1_speedup_5x"] = out["b1_graphs_speedup"] >= 5
    return out


def phase_attention(args, ctx) -> dict:
    import torch

    from polyrunner.backends.cuda.triton_attention import unified_attention
    from polyrunner.plugin_api import LayerSpec, cdiv
    name = torch.cuda.get_device_properties(0).name
    peak = next((bw for key, bw in HBM_PEAK.items() if key in name), None)
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy = torch.empty_like(big)
    for _ in range(3):
        copy.copy_(big)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        copy.copy_(big)
    torch.cuda.synchronize()
    measured = 2 * big.numel() * 10 / (time.perf_counter() - t0)
    del big, copy
    free()
    floor_bw = peak or measured
    spec = LayerSpec(9, 3, 64, 64 ** -0.5)
    bs, out = 16, {"gpu": name, "hbm_peak_gbs": peak and peak / 1e9, "copy_gbs": round(measured / 1e9)}
    for B in (1, 32, 64, 128):
        for ctx_len in (512, 2048, 8192):
            nblk = cdiv(ctx_len, bs)
            cache = torch.randn(2, B * nblk + 1, bs, 3, 64, device="cuda", dtype=torch.bfloat16)
            tables = (torch.randperm(B * nblk, device="cuda") + 1).view(B, nblk).int()
            q = torch.randn(B, 9, 64, device="cuda", dtype=torch.bfloat16)
            qsl = torch.arange(B + 1, device="cuda", dtype=torch.int32)
            lens = torch.full((B,), ctx_len, device="cuda", dtype=torch.int32)
            run = functools.partial(unified_attention, q, cache[0], cache[1], qsl, lens, tables, spec,
                                    decode_only=True)
            for _ in range(3):
                run()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                run()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / 20
            kv_bytes = 2 * B * ctx_len * 3 * 64 * 2
            out[f"b{B}_ctx{ctx_len}"] = {"us": round(ms * 1e3, 1),
                                         "of_floor": round(kv_bytes / floor_bw / (ms * 1e-3), 3)}
            del cache, tables, q, run
            free()
    out["target_b64_2k_70pct"] = out["b64_ctx2048"]["of_floor"] >= 0.70
    return out


def phase_memory(args, ctx) -> dict:
    import torch

    from polyrunner import LLM
    path, what = model_source(args, ctx)
    t0 = time.perf_counter()
    llm = LLM(path, backend="cuda")  # defaults: dtype auto, the model's max_model_len, 0.9 of the GPU
    eng = llm.engine
    ex = eng.runner.executor
    out = {"model": what, "init_s": round(time.perf_counter() - t0, 1), "max_model_len": eng.max_model_len,
           "kv_blocks": eng.runner.num_blocks, "capture_s": round(ex.capture_seconds, 2),
           "capture_mib": round(ex.capture_bytes / 2**20, 1), "reserved_mib": round(ex.reserved_bytes / 2**20, 1),
           "graphs": ex.num_graphs()}
    long = random_prompts(1, eng.max_model_len - 16, eng.max_model_len - 16, 49000, seed=5)
    generate(llm, long, 8)
    generate(llm, random_prompts(eng.config.scheduler.max_num_seqs, 256, 256, 49000, seed=6), 8)
    out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["no_oom"] = True
    del llm, eng, ex
    free()
    return out


def phase_prefill(args, ctx) -> dict:
    from polyrunner import LLM
    path, what = model_source(args, ctx)
    llm = LLM(path, backend="cuda", dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
              max_model_len=4096, kv_cache_memory_bytes=2 << 30)
    p = random_prompts(1, 2048, 2048, 49000, seed=7)
    generate(llm, p, 1)
    _, t = generate(llm, random_prompts(1, 2048, 2048, 49000, seed=8), 1)
    del llm
    free()
    return {"model": what, "prefill_tok_s": round(2048 / t)}


PHASES = [("env", 30, phase_env), ("tests", 150, phase_tests), ("tiny", 45, phase_tiny),
          ("model", 60, phase_model), ("decode", 90, phase_decode), ("attention", 40, phase_attention),
          ("memory", 60, phase_memory), ("prefill", 20, phase_prefill)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or HF folder (default: the embedded SmolLM2 GGUF if installed)")
    ap.add_argument("--deadline", type=float, default=480.0, help="global seconds (default 480)")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl",
                    help="wheels to install first, without network (default .whl; see cuda_wheels.py)")
    args = ap.parse_args()
    t_start = time.monotonic()
    ctx = {"tmp": tempfile.mkdtemp(prefix="cuda-check-")}
    summary: dict = {"setup": prepare(args.wheels, Path(ctx["tmp"]) / "site")}
    try:
        missing = summary["setup"]["missing"]
        gpu = not missing and cuda_available()
        for name, budget, fn in PHASES:
            left = args.deadline - (time.monotonic() - t_start) - 10
            if name in args.skip.split(","):
                summary[name] = {"skipped": "--skip"}
                continue
            if missing:
                summary[name] = {"skipped": f"setup: cannot import {', '.join(m.split()[0] for m in missing)}"}
                continue
            if not gpu and name not in ("env",):
                summary[name] = {"skipped": "no CUDA device (torch.cuda.is_available() is False)"}
                continue
            if left < 15:
                summary[name] = {"skipped": "global deadline"}
                continue
            ctx["limit"] = min(budget, left)
            t0 = time.perf_counter()
            try:
                with time_limit(ctx["limit"]):
                    summary[name] = fn(args, ctx)
            except BaseException as exc:  # noqa: BLE001 - every phase reports, none stops the summary
                if isinstance(exc, KeyboardInterrupt):
                    raise
                summary[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}",
                                 "where": traceback.format_exc(limit=3)[-600:]}
                with contextlib.suppress(Exception):
                    free()
            summary[name]["seconds"] = round(time.perf_counter() - t0, 1)
    finally:
        summary["total_seconds"] = round(time.monotonic() - t_start, 1)
        print("\n==== cuda_check summary ====")
        for name, res in summary.items():
            print(f"{name}: {res if not isinstance(res, dict) else json.dumps(res, default=str)[:1500]}")
        print(json.dumps(summary, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
