"""One-shot check of the CUDA backend on a lent GPU (an H200 image: PyTorch, CUDA and
Triton preinstalled, no network), with a verdict. Runs from the repository root:

    python benchmarks/cuda_check.py [--model PATH.gguf|HF-folder] [--deadline 480] [--json OUT]

First (`cuda_check_setup.py`) installs the wheels of `--wheels` (default `.whl`,
made here by `cuda_wheels.py`: pydantic and its dependencies, gguf) with pip
`--no-index --target`, makes polyrunner importable from this tree without
installing it, and checks every import up front (what is missing is named, with
the fix). It prints the targets (`TARGETS`), then runs phases, each under its own
time limit and all under a global deadline (8 minutes by default):

  env         versions, GPU, triton / attention op in use (runs without a GPU too)
  tests       pytest of the Triton, graph and CUDA-backend tests (GPU cases run)
  tiny        a tiny float32 Llama: greedy tokens of cuda (FULL_DECODE_ONLY graphs,
              FULL graphs, eager) vs the CPU backend; the FULL run's eager steps
  model       SmolLM2-135M (the embedded GGUF when found, else random weights of
              its shape): bfloat16 cuda vs float32 CPU greedy tokens
  decode      decode ms/token with graphs vs enforce_eager at batch 1, and ms/step
              at batch 64 with 2k contexts (prefix caching off)
  attention   the Triton decode kernel alone, batch x context grid, against the
              measured device-to-device copy bandwidth
  memory      default settings (max_model_len of the model, gpu_memory_utilization
              0.9): a prompt of max_model_len - 16 tokens and a full batch
  prefill     prefill tokens/s of one 2048-token prompt (no target)

Each phase returns its measurements and, under "checks", each target it checked
({"ok", "detail"}). It ALWAYS ends with a summary, the verdict line and one JSON line
(also written to `--json OUT`, the record), whatever failed. Verdict (`verdict()`):

  FAIL    a required import is missing; a phase raised or timed out; a phase was
          skipped for a reason other than "no CUDA device" or `--skip` (the global
          deadline); a target was missed or not reported. Exit status 1.
  NO GPU  no CUDA device: every GPU phase skipped, nothing else failed. Exit 0.
  PASS    every phase that ran met its targets. Phases named by `--skip` are stated
          in the verdict line with the targets they would have checked:
          "PASS (skipped by --skip: ...)" is a pass of the rest only. Exit 0.

Targets and their record are described in benchmarks/README.md (CUDA section).
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cuda_check_setup import prepare

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_SHAPE = dict(vocab=49152, hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, max_pos=8192)
SMOLLM2_VOCAB = 49000            # random prompt ids stay below SmolLM2's vocabulary
GPU_BACKEND = "cuda"             # the backend under test (the CPU backend is the reference)
NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"   # the one skip that does not fail the verdict
USER_SKIP = "--skip"

# ---- targets ---------------------------------------------------------------------------
# Tie margin (nats), by the dtype the GPU computes in: where the CPU reference's top-1 and top-2
# logprobs are closer than this, rounding alone may swap them, so a different GPU token there is
# excused (and ends that sequence's comparison: past it the two continue different texts).
# float32: both sides float32 with IEEE dots (the Triton kernels' input_precision="ieee"); float32
#   roundings over the tiny model's 2 layers of width 64 move its logits by ~1e-6 (an estimate, not
#   measured on a GPU), so 1e-3 is far above them while most of its gaps (0.01-0.5) stay checked.
# bfloat16 vs the float32 reference: measured on the CPU backend (SmolLM2-135M GGUF, 24 random
#   prompts x 32 tokens), bfloat16 moved the top-1 minus top-2 gap by 0.075 on average, 0.31 at
#   the 99th percentile, 0.66 at most (1 of 598 positions above 0.5); 3/4 of the reference's
#   positions have a gap above 0.5, so they are still checked.
TIE_MARGIN = {"float32": 1e-3, "bfloat16": 0.5}
GRAPHS_SPEEDUP_MIN = 5.0         # batch-1 decode, graphs vs enforce_eager
ATTENTION_OF_COPY_MIN = 0.70     # batch-64, 2k-context decode attention vs the measured copy bandwidth

TARGETS: dict[str, str] = {
    "tokens": "greedy tokens equal the float32 CPU backend's wherever the reference's top-1 and top-2 "
              "logprobs differ by more than the tie margin (" + ", ".join(
                  f"{dtype} {margin:g}" for dtype, margin in TIE_MARGIN.items()) + " nats, by the GPU's "
              "dtype); each sequence compared up to its first divergence",
    "graphs_speedup": f"decode at batch 1 on SmolLM2-shaped weights: graphs >= {GRAPHS_SPEEDUP_MIN:g}x "
                      "enforce_eager (ms/token, prefix caching off)",
    "attention_bandwidth": "Triton decode attention at batch 64 with 2k contexts: K+V bytes / kernel time >= "
                           f"{ATTENTION_OF_COPY_MIN:.0%} of the device-to-device copy bandwidth measured in the run",
    "no_oom": "default settings (the model's max_model_len, gpu_memory_utilization 0.9): a prompt of "
              "max_model_len - 16 tokens and a full max_num_seqs batch run without out-of-memory",
    "full_no_eager": "cudagraph_mode=FULL (Triton attention): the executor stays FULL, decode and mixed graphs "
                     "replay, and zero steps run eagerly, whatever the reason (the run's limits keep every "
                     "step within the captured sizes, so even 'too_large' counts)",
    "gpu_tests": "the Triton, graph and CUDA-backend tests pass with their GPU cases (pytest exit 0)",
}


def check(ok: bool, detail: str) -> dict[str, Any]:
    """One target's result in a phase's "checks"."""
    return {"ok": bool(ok), "detail": detail}


class PhaseTimeout(Exception):
    """A phase ran past its time limit."""


class MeasurementError(Exception):
    """A timing that cannot be right (e.g. a non-positive ms/step): the phase fails."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise PhaseTimeout in the main thread after `seconds` (between Python bytecodes)."""
    def fire(signum: int, frame: Any) -> None:
        raise PhaseTimeout(f"phase exceeded {seconds:.0f}s")
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- helpers ---------------------------------------------------------------------------
def write_llama(folder: Path, *, vocab: int = 512, hidden: int = 64, inter: int = 128, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, max_pos: int = 2048, seed: int = 0, std: float = 0.08,
                dtype: str = "float32") -> Path:
    """A random Llama checkpoint (config.json + safetensors): the conformance suite's writer."""
    from polyrunner.tools.conformance.tiny_llama import write_tiny_llama
    return write_tiny_llama(folder, seed=seed, std=std, dtype=dtype, vocab_size=vocab, hidden_size=hidden,
                            intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                            num_key_value_heads=kv_heads, max_position_embeddings=max_pos)


def cuda_available() -> bool:
    """Whether torch sees a CUDA device; without torch, whether the NVIDIA driver lists a GPU."""
    try:
        import torch
    except ImportError:
        gpus = Path("/proc/driver/nvidia/gpus")
        return gpus.is_dir() and any(gpus.iterdir())
    return bool(torch.cuda.is_available())


def free() -> None:
    """Return cached GPU memory (callers drop their references first)."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist()}
            for _ in range(n)]


def generate(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy token ids of each prompt and the wall seconds of the call."""
    import torch

    from polyrunner import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


@dataclass
class Reference:
    """The CPU backend's greedy tokens and, per position, its top-1 minus top-2 logprob."""

    tokens: list[list[int]]
    gaps: list[list[float]]


def reference(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int) -> Reference:
    """Greedy tokens of `llm` (the CPU backend) with logprobs=2, for `compare_tokens`."""
    from polyrunner import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return Reference([list(o.token_ids) for o in outs], [[top2_gap(p) for p in o.logprobs] for o in outs])


def top2_gap(position: dict[int, Any]) -> float:
    """Top-1 minus top-2 logprob of one position's {token: Logprob} (the sampled token plus the top 2)."""
    first, second = sorted((lp.logprob for lp in position.values()), reverse=True)[:2]
    return float(first - second)


def compare_tokens(ref: Reference, got: list[list[int]], margin: float) -> dict[str, Any]:
    """`got` vs the reference, each sequence up to its first divergence: "mismatches" are
    divergences where the reference's top-2 gap exceeds `margin` (or a length differs),
    "excused" those within it (a near tie rounding may swap); "ok" when there is no mismatch."""
    compared = 0
    excused: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    for i, (want, gaps, have) in enumerate(zip(ref.tokens, ref.gaps, got, strict=True)):
        j = next((j for j, (u, v) in enumerate(zip(want, have)) if u != v), None)
        if j is None:
            compared += min(len(want), len(have))
            if len(want) != len(have):
                mismatches.append({"prompt": i, "length": len(have), "cpu_length": len(want)})
            continue
        compared += j + 1
        where: dict[str, Any] = {"prompt": i, "token": j, "gap": round(gaps[j], 5), "cpu": want[j], "gpu": have[j]}
        (excused if gaps[j] <= margin else mismatches).append(where)
    return {"ok": not mismatches, "compared": compared, "excused": excused, "mismatches": mismatches}


def tokens_detail(runs: dict[str, dict[str, Any]], margin: float) -> str:
    """One line for the "tokens" check over `compare_tokens` results by run name."""
    parts = []
    for name, r in runs.items():
        part = f"{name}: {r['compared']} compared, {len(r['excused'])} tie-excused (margin {margin:g})"
        if r["mismatches"]:
            part += f", {len(r['mismatches'])} MISMATCHED, first {r['mismatches'][0]}"
        parts.append(part)
    return "; ".join(parts)


def counter_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a graph executor's `counters()` gained between two reads (mode as of `after`)."""
    eager = {r: n - before["eager"].get(r, 0) for r, n in after["eager"].items() if n != before["eager"].get(r, 0)}
    return {"mode": after["mode"], "replays": after["replays"] - before["replays"],
            "mixed_replays": after["mixed_replays"] - before["mixed_replays"], "eager": eager}


def full_mode_check(delta: dict[str, Any], fallback_reason: str | None) -> dict[str, Any]:
    """The "full_no_eager" target on a FULL-mode run's `counter_delta`."""
    problems = []
    if delta["mode"] != "FULL":
        problems.append(f"mode {delta['mode']}" + (f" ({fallback_reason})" if fallback_reason else ""))
    if delta["eager"]:
        problems.append(f"eager steps by reason {delta['eager']}")
    if delta["mixed_replays"] <= 0:
        problems.append("no mixed graph replayed")
    if delta["replays"] - delta["mixed_replays"] <= 0:
        problems.append("no decode graph replayed")
    summary = f"{delta['replays']} replays ({delta['mixed_replays']} mixed)"
    return check(not problems, f"{'; '.join(problems)}; {summary}" if problems else f"FULL, {summary}, 0 eager")


def ms_per_step(llm: Any, prompts: list[dict[str, list[int]]], steps: int) -> float:
    """Decode ms per step: (generate 1 + `steps` tokens - generate 1 token) / `steps`. Both calls
    prefill the same prompts from scratch (the caller's LLM has prefix caching off)."""
    _, t1 = generate(llm, prompts, 1)
    _, tn = generate(llm, prompts, 1 + steps)
    ms = (tn - t1) / steps * 1e3
    if ms <= 0:
        raise MeasurementError(f"non-positive decode time {ms:.4f} ms/step ({1 + steps} tokens in {tn:.4f}s, "
                               f"1 token in {t1:.4f}s)")
    return round(ms, 3)


# ---- phases -------------------------------------------------------------------------
Ctx = dict[str, Any]   # "tmp": a scratch folder; "limit": the phase's seconds


def phase_env(args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    import torch
    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
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


def phase_tests(args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    files = ["tests/test_triton_attention.py", "tests/test_triton_fused_ops.py", "tests/test_triton_moe.py",
             "tests/test_cuda_graphs.py",
             "tests/test_graph_modes.py", "tests/test_cuda_backend.py", "tests/test_pinned_staging.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-x", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, capture_output=True, text=True, timeout=ctx["limit"] - 5)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    result = lines[-1] if lines else proc.stderr[-400:]
    return {"rc": proc.returncode, "result": result,
            "failures": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:10],
            "skipped": [ln[:200] for ln in lines if ln.startswith("SKIPPED")][:6],
            "tail": "\n".join(lines[-25:]) if proc.returncode else "",
            "checks": {"gpu_tests": check(proc.returncode == 0, f"pytest exit {proc.returncode}: {result}")}}


def phase_tiny(args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    from polyrunner import LLM
    folder = write_llama(Path(ctx["tmp"]) / "tiny")
    prompts = random_prompts(12, 4, 60, 512, seed=1)
    # 128 batched tokens <= the 512-token cap of FULL's mixed graphs, batches <= max_num_seqs: every
    # step of the FULL run fits a captured graph
    kw: dict[str, Any] = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, block_size=16,
                              kv_cache_memory_bytes=64 << 20)
    llm = LLM(str(folder), backend="cpu", **kw)
    ref = reference(llm, prompts, 24)
    del llm
    runs: dict[str, dict[str, Any]] = {   # the default with the Triton attention is FULL
        "cuda_decode_graphs": {"cudagraph_mode": "FULL_DECODE_ONLY"}, "cuda_full": {"cudagraph_mode": "FULL"},
        "cuda_eager": {"enforce_eager": True}}
    tokens: dict[str, list[list[int]]] = {}
    counters: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for name, opts in runs.items():
        llm = LLM(str(folder), backend=GPU_BACKEND, **kw, **opts)
        ex = llm.engine.runner.executor
        before = ex.counters()
        tokens[name], _ = generate(llm, prompts, 24)
        counters[name] = counter_delta(before, ex.counters())
        if name == "cuda_full":
            out["full_check"] = full_mode_check(counters[name], ex.fallback_reason)
        del llm, ex
        free()
    margin = TIE_MARGIN["float32"]
    compared = {n: compare_tokens(ref, t, margin) for n, t in tokens.items()}
    out |= {"vs_cpu": compared, "counters": counters,
            "graphs_vs_eager": {n: "identical" if tokens[n] == tokens["cuda_eager"] else "differ"
                                for n in ("cuda_decode_graphs", "cuda_full")}}
    out["checks"] = {"tokens": check(all(r["ok"] for r in compared.values()), tokens_detail(compared, margin)),
                     "full_no_eager": out.pop("full_check")}
    return out


def model_source(args: argparse.Namespace, ctx: Ctx) -> tuple[str, str]:
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


def phase_model(args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    from polyrunner import LLM
    path, what = model_source(args, ctx)
    prompts = random_prompts(6, 8, 40, SMOLLM2_VOCAB, seed=2)
    kw: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory_bytes=512 << 20,
                              max_model_len=1024)
    cpu = LLM(path, backend="cpu", dtype="float32", **kw)
    ref = reference(cpu, prompts, 32)
    del cpu
    free()
    gpu = LLM(path, backend=GPU_BACKEND, dtype="bfloat16", **kw)
    got, _ = generate(gpu, prompts, 32)
    del gpu
    free()
    margin = TIE_MARGIN["bfloat16"]
    result = compare_tokens(ref, got, margin)
    same = sum(u == v for x, y in zip(ref.tokens, got) for u, v in zip(x, y))
    return {"model": what, "token_match_rate": round(same / sum(map(len, ref.tokens)), 3), "vs_cpu": result,
            "checks": {"tokens": check(result["ok"], tokens_detail({"bfloat16": result}, margin))}}


def phase_decode(args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    from polyrunner import LLM
    path, what = model_source(args, ctx)
    out: dict[str, Any] = {"model": what, "prefix_caching": False}
    one = random_prompts(1, 32, 32, SMOLLM2_VOCAB, seed=3)
    batch = random_prompts(64, 2048, 2048, SMOLLM2_VOCAB, seed=4)
    for name, eager in (("graphs", False), ("eager", True)):
        # prefix caching off: every timed call prefills its prompts in full, so the 1-token call
        # subtracts the same prefill the (1 + steps)-token call made
        llm = LLM(path, backend=GPU_BACKEND, dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=8192,
                  max_model_len=4096, kv_cache_memory_bytes=8 << 30, enforce_eager=eager,
                  enable_prefix_caching=False)
        generate(llm, one, 8)      # warm-up
        out[f"b1_ms_per_token_{name}"] = ms_per_step(llm, one, 128)
        generate(llm, batch, 2)    # warm-up at the batch-64, 2k shapes
        out[f"b64_ctx2k_ms_per_step_{name}"] = ms_per_step(llm, batch, 32)
        if not eager:
            ex = llm.engine.runner.executor
            out["counters"] = ex.counters()
            out["capture_s"], out["capture_mib"] = round(ex.capture_seconds, 2), round(ex.capture_bytes / 2**20, 1)
            del ex
        del llm
        free()
    speedup = out["b1_ms_per_token_eager"] / out["b1_ms_per_token_graphs"]
    out["b1_graphs_speedup"] = round(speedup, 2)
    out["checks"] = {"graphs_speedup": check(
        speedup >= GRAPHS_SPEEDUP_MIN, f"{speedup:.2f}x ({out['b1_ms_per_token_eager']} ms eager / "
        f"{out['b1_ms_per_token_graphs']} ms graphs; target >= {GRAPHS_SPEEDUP_MIN:g}x, {what})")}
    return out


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (each copy reads and writes `nbytes`)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    free()
    return float(2 * nbytes * reps / seconds)


def phase_attention(args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    import torch

    from polyrunner.backends.cuda.triton_attention import unified_attention
    from polyrunner.plugin_api import LayerSpec, cdiv
    floor_bw = copy_bandwidth()
    spec = LayerSpec(9, 3, 64, 64 ** -0.5)
    bs = 16
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_properties(0).name, "copy_gbs": round(floor_bw / 1e9)}
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
                                         "of_copy": round(kv_bytes / floor_bw / (ms * 1e-3), 3)}
            del cache, tables, q, run
            free()
    frac = out["b64_ctx2048"]["of_copy"]
    out["checks"] = {"attention_bandwidth": check(
        frac >= ATTENTION_OF_COPY_MIN, f"{frac:.1%} of the measured copy bandwidth ({out['copy_gbs']} GB/s; "
        f"target >= {ATTENTION_OF_COPY_MIN:.0%})")}
    return out


def phase_memory(args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    import torch

    from polyrunner import LLM
    path, what = model_source(args, ctx)
    out: dict[str, Any] = {"model": what}
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        llm = LLM(path, backend=GPU_BACKEND)  # defaults: dtype auto, the model's max_model_len, 0.9 of the GPU
        eng = llm.engine
        ex = eng.runner.executor
        out |= {"init_s": round(time.perf_counter() - t0, 1), "max_model_len": eng.max_model_len,
                "kv_blocks": eng.runner.num_blocks, "capture_s": round(ex.capture_seconds, 2),
                "capture_mib": round(ex.capture_bytes / 2**20, 1),
                "reserved_mib": round(ex.reserved_bytes / 2**20, 1), "graphs": ex.num_graphs()}
        long = random_prompts(1, eng.max_model_len - 16, eng.max_model_len - 16, SMOLLM2_VOCAB, seed=5)
        generate(llm, long, 8)
        generate(llm, random_prompts(eng.config.scheduler.max_num_seqs, 256, 256, SMOLLM2_VOCAB, seed=6), 8)
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["checks"] = {"no_oom": check(True, f"max_model_len {eng.max_model_len}, peak {out['peak_gib']} GiB")}
        del llm, eng, ex
    except torch.cuda.OutOfMemoryError as exc:
        out["checks"] = {"no_oom": check(False, f"OutOfMemoryError: {str(exc)[:300]}")}
    free()
    return out


def phase_prefill(args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    from polyrunner import LLM
    path, what = model_source(args, ctx)
    llm = LLM(path, backend=GPU_BACKEND, dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048,
              max_model_len=4096, kv_cache_memory_bytes=2 << 30)
    generate(llm, random_prompts(1, 2048, 2048, SMOLLM2_VOCAB, seed=7), 1)
    _, t = generate(llm, random_prompts(1, 2048, 2048, SMOLLM2_VOCAB, seed=8), 1)
    del llm
    free()
    return {"model": what, "prefill_tok_s": round(2048 / t)}


@dataclass(frozen=True)
class Phase:
    """A phase: its seconds, what it runs, the targets it must report under "checks"."""

    name: str
    budget: float
    run: Callable[[argparse.Namespace, Ctx], dict[str, Any]]
    targets: tuple[str, ...] = ()
    needs_gpu: bool = True


PHASES = [Phase("env", 30, phase_env, needs_gpu=False),
          Phase("tests", 150, phase_tests, ("gpu_tests",)),
          Phase("tiny", 60, phase_tiny, ("tokens", "full_no_eager")),
          Phase("model", 60, phase_model, ("tokens",)),
          Phase("decode", 90, phase_decode, ("graphs_speedup",)),
          Phase("attention", 40, phase_attention, ("attention_bandwidth",)),
          Phase("memory", 60, phase_memory, ("no_oom",)),
          Phase("prefill", 20, phase_prefill)]


# ---- verdict --------------------------------------------------------------------------
def verdict(summary: dict[str, Any], phases: list[Phase], gpu: bool) -> dict[str, Any]:
    """{"result": "PASS" | "FAIL" | "NO GPU", "failures", "user_skipped", "line"} from the summary
    (rules in the module docstring)."""
    failures: list[str] = []
    missing = summary.get("setup", {}).get("missing") or []
    if missing:
        failures.append(f"setup: cannot import {', '.join(m.split()[0] for m in missing)}")
    skipped_by: dict[str, list[str]] = {}      # a skip reason that fails -> phases
    user_skipped: dict[str, list[str]] = {}    # phase -> the targets it would have checked
    for phase in phases:
        res = summary.get(phase.name, {"error": "no result"})
        if "error" in res:
            failures.append(f"{phase.name}: {res['error']}")
        elif "skipped" in res:
            if res["skipped"] == USER_SKIP:
                user_skipped[phase.name] = list(phase.targets)
            elif res["skipped"] != NO_GPU or gpu:
                skipped_by.setdefault(res["skipped"], []).append(phase.name)
        else:
            checks = res.get("checks", {})
            failures += [f"{phase.name}: {t} not reported" for t in phase.targets if t not in checks]
            failures += [f"{phase.name}: {t} missed ({c['detail']})" for t, c in checks.items() if not c["ok"]]
    failures += [f"{', '.join(names)}: skipped ({why})" for why, names in skipped_by.items()]
    if failures:
        result, line = "FAIL", f"FAIL ({'; '.join(failures)})"
    elif not gpu:
        result, line = "NO GPU", "NO GPU (every GPU phase skipped: no CUDA device; no target checked)"
    else:
        result, line = "PASS", "PASS"
        if user_skipped:
            line += " (skipped by --skip: " + ", ".join(
                f"{n} [{', '.join(t) or 'no target'}]" for n, t in user_skipped.items()) + ")"
    return {"result": result, "failures": failures, "user_skipped": user_skipped, "line": f"cuda_check: {line}"}


def run_phase(phase: Phase, args: argparse.Namespace, ctx: Ctx) -> dict[str, Any]:
    """The phase's result under its time limit; an exception becomes {"error", "where"}."""
    t0 = time.perf_counter()
    try:
        with time_limit(ctx["limit"]):
            res = phase.run(args, ctx)
    except BaseException as exc:  # noqa: BLE001 - every phase reports, none stops the summary
        if isinstance(exc, KeyboardInterrupt):
            raise
        res = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "where": traceback.format_exc(limit=3)[-600:]}
        with contextlib.suppress(Exception):
            free()
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="GGUF file or HF folder (default: the embedded SmolLM2 GGUF if installed)")
    ap.add_argument("--deadline", type=float, default=480.0, help="global seconds (default 480)")
    ap.add_argument("--skip", default="", help="comma-separated phases to skip (named in the verdict)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the JSON record (summary + verdict) here")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl",
                    help="wheels to install first, without network (default .whl; see cuda_wheels.py)")
    args = ap.parse_args(argv)
    args.skip = [s for s in args.skip.split(",") if s]
    unknown = sorted(set(args.skip) - {p.name for p in PHASES})
    if unknown:
        ap.error(f"--skip: no phase {', '.join(unknown)} (phases: {', '.join(p.name for p in PHASES)})")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the check; 1 when the verdict is FAIL, else 0."""
    args = parse_args(argv)
    t_start = time.monotonic()
    print("cuda_check targets:")
    for name, text in TARGETS.items():
        print(f"  {name}: {text}")
    summary: dict[str, Any] = {"targets": TARGETS}
    with tempfile.TemporaryDirectory(prefix="cuda-check-", ignore_cleanup_errors=True) as tmp:
        ctx: Ctx = {"tmp": tmp}
        summary["setup"] = prepare(args.wheels, Path(tmp) / "site")
        missing = summary["setup"]["missing"]
        gpu = cuda_available()
        try:
            for phase in PHASES:
                left = args.deadline - (time.monotonic() - t_start) - 10
                if phase.name in args.skip:
                    summary[phase.name] = {"skipped": USER_SKIP}
                elif phase.needs_gpu and not gpu:
                    summary[phase.name] = {"skipped": NO_GPU}
                elif missing:
                    summary[phase.name] = {"skipped": f"setup: cannot import "
                                                      f"{', '.join(m.split()[0] for m in missing)}"}
                elif left < 15:
                    summary[phase.name] = {"skipped": "global deadline"}
                else:
                    ctx["limit"] = min(phase.budget, left)
                    summary[phase.name] = run_phase(phase, args, ctx)
        finally:
            summary["total_seconds"] = round(time.monotonic() - t_start, 1)
            summary["verdict"] = verdict(summary, PHASES, gpu)
            print("\n==== cuda_check summary ====")
            for name, res in summary.items():
                if name not in ("targets", "verdict"):
                    print(f"{name}: {res if not isinstance(res, dict) else json.dumps(res, default=str)[:1500]}")
            print(summary["verdict"]["line"])
            record = json.dumps(summary, default=str)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(record + "\n")
            print(record, flush=True)
    return 1 if summary["verdict"]["result"] == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
