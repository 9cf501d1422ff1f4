"""`compare.py --model`: every anchor on the random-weight models of real shapes
(benchmarks/realistic_models.py), in interleaved rounds, one table per model.

- polyrunner-quant: each GGUF file as `LLM()` runs it by default (quantized).
- llama.cpp: the same GGUF files (benchmarks/llama_cpp_workload.py, llama-cpp-python built by compare.py).
- polyrunner: the bf16 HF folder in `--bf16-dtype` (bfloat16: the dtype of the file; "auto" would pick
  float32 on a CPU without AVX512_BF16 or AMX and hold twice the bytes).
- vllm-compiled (and vllm-eager with `--vllm-modes compiled eager`): the bf16 HF folder, same dtype,
  max_num_batched_tokens VLLM_MAX_NUM_BATCHED_TOKENS.

Every job is a fresh worker process per round (benchmarks/rounds.py): its start-up (the `LLM(...)` call,
llama.cpp's model load + context) and resident memory (after load, peak during load, at the end) are
measured there. W2 and W3, greedy, ignore_eos, the workloads of core/tools/bench/workloads.py. The KV
cache budget is the same for polyrunner and vLLM and sized to W2 (`kv_cache_gib`). The streaming-read
bandwidth is measured before and after each model's rounds (benchmarks/bandwidth.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bandwidth
import engines
import realistic_models as rm
from compare import times_better
from gguf_quantize import llama_cpp_tools
from rounds import Job, describe, run_rounds, summary

GIB = 1 << 30


def kv_cache_gib(shape: rm.Shape, seqs: int = 8, tokens: int = 32 + 512 + 16) -> int:
    """GiB of KV cache W2 needs in float32 (the widest KV dtype an engine picks here), with 25% margin."""
    c = shape.config
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * shape.head_dim * 4
    return max(1, math.ceil(per_token * seqs * tokens * 1.25 / GIB))


# vLLM's max_num_batched_tokens: W2's whole prefill (8 prompts x 32 tokens) in one step, as polyrunner's 2048
# does, so no workload's prefill is chunked. vLLM's compiled mode warms up with one forward of this many
# tokens (cpu_model_runner.warming_up_model -> profile_run); at vLLM's default, and without AVX512_BF16 or
# AMX (its bf16 linears then run torch's reference GEMM, 7-10 GFLOP/s on 2 Zen 3 cores), that forward of
# 2048 tokens is ~7 TFLOP on SmolLM2-1.7B: 12-17 minutes per start (over 35 on a busy host); 256: an eighth.
VLLM_MAX_NUM_BATCHED_TOKENS = 256


def build_jobs(ms: rm.ModelSet, args, threads: int, llama_python: Path | None, vllm_python: Path | None,
               kv_gib: int) -> list[Job]:
    """Per GGUF type polyrunner-quant and llama.cpp; on the bf16 folder polyrunner and vLLM (`--vllm-modes`)."""
    workloads, cap = list(args.workload), args.max_tokens
    jobs = []
    for t in rm.GGUF_TYPES:
        if t not in ms.files:
            continue
        path = str(ms.files[t])
        jobs.append(engines.polyrunner_job("polyrunner-quant", t, path, workloads, cap, kv_cache_bytes=kv_gib * GIB))
        if llama_python is not None:
            jobs.append(engines.llama_cpp_job(llama_python, t, path, workloads, threads, cap))
    if "bf16" in ms.files:
        path = str(ms.files["bf16"])
        jobs.append(engines.polyrunner_job("polyrunner", "bf16", path, workloads, cap, dtype=args.bf16_dtype,
                                           kv_cache_bytes=kv_gib * GIB))
        if vllm_python is not None:
            for mode in args.vllm_modes:
                jobs.append(engines.vllm_job(vllm_python, mode, "bf16", path, args.bf16_dtype, workloads, cap,
                                             kv_cache_gib=kv_gib, max_num_batched_tokens=VLLM_MAX_NUM_BATCHED_TOKENS))
    return jobs


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def model_table(rows: list[dict[str, Any]], bw: float, flags: str, header: list[str]) -> str:
    """`header`, then one line per engine and file (`rounds.summary` of its job plus `bandwidth.file_weight_bytes`
    of its file), the ratio lines, the engines not measured and why, and the CPU flags. Adds each row's
    `w3_tok_s` and `bandwidth_used` (of the streaming-read bandwidth `bw`, bytes/s) to the row, for the JSON."""
    head = ["engine", "file", "file GB", "read/token GB", "W2 out tok/s", "W2 ms/token", "W3 TTFT ms",
            "W3 ms/token", "W3 tok/s", "bw used", "start 1st s", "start later s", "RSS load GB",
            "peak load GB", "RSS end GB", "RSS end/file", "rounds"]
    table = [head]
    for r in rows:
        w2, w3 = r.get("w2", {}), r.get("w3", {})
        tps = 1e3 / w3["tpot_ms"] if w3.get("tpot_ms") else None
        used = bandwidth.bandwidth_used(r["read_per_token"], tps, bw) if tps else None
        ratio = r["rss_end"] / r["file_bytes"] if r.get("rss_end") else None
        table.append([r["engine"], r["file"], _gb(r["file_bytes"]), _gb(r["read_per_token"]),
                      _f(w2.get("output_tok_s")), _f(w2.get("tpot_ms")), _f(w3.get("ttft_ms")),
                      _f(w3.get("tpot_ms")), _f(tps), "-" if used is None else f"{100 * used:.0f}%",
                      _f(r.get("start_first_s"), "{:.2f}"), _f(r.get("start_later_s"), "{:.2f}"),
                      _gb(r.get("rss_after_load")), _gb(r.get("peak_load")), _gb(r.get("rss_end")),
                      _f(ratio, "{:.2f}x"), str(r["rounds"])])
        r["w3_tok_s"], r["bandwidth_used"] = tps, used
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = list(header)
    lines += ["  ".join(c.ljust(wd) if i < 2 else c.rjust(wd) for i, (c, wd) in enumerate(zip(row, widths)))
              for row in table]
    lines.insert(len(header) + 1, "-" * len(lines[len(header)]))
    lines += ratio_lines(rows)
    for r in rows:
        if r.get("error"):
            lines.append(f"{r['engine']} {r['file']}: not measured: {r['error']}")
    lines.append(f"CPU flags: {flags}")
    return "\n".join(lines)


RATIOS = [("W2 out tok/s", "w2", "output_tok_s", True), ("W3 time/token", "w3", "tpot_ms", False),
          ("W3 TTFT", "w3", "ttft_ms", False)]


def ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    """How many times better polyrunner's medians are than each anchor's on the same file: polyrunner-quant x
    llama.cpp per GGUF type, polyrunner x vLLM on bf16 (W2 output tok/s, W3 time per output token, W3 TTFT)."""
    by = {(r["engine"], r["file"]): r for r in rows}
    out = []
    for (engine, file), ours in by.items():
        if engine not in ("polyrunner-quant", "polyrunner"):
            continue
        for anchor in ("llama.cpp", "vllm-compiled", "vllm-eager"):
            other = by.get((anchor, file))
            if other is None or not other.get("w2") and not other.get("w3"):
                continue
            parts = [f"{label} {times_better(other.get(w, {}).get(key), ours.get(w, {}).get(key), higher)}"
                     for label, w, key, higher in RATIOS]
            out.append(f"{engine} x {anchor} ({file}): " + ", ".join(parts))
    return out


def _marker(python: Path | None) -> str:
    if python is None:
        return "-"
    marker = python.parent.parent / ".polyrunner-ready"
    return marker.read_text().strip() if marker.is_file() else "?"


def _header(shape: rm.Shape, args, threads: int, flags: str, kv_gib: int, bw: float, bw_before: dict,
            bw_after: dict, passes: int, when: tuple[float, tuple, tuple]) -> list[str]:
    """The lines above a model's table: what the model is, how it was run, the streaming-read bandwidth and
    the CPU flags beside it, the time and the load average (`when`: start time, load average at start, end)."""
    t0, load_start, load_end = when
    return [
        f"== {shape.name}: random weights (normal(0, {rm.STD})) of the real shape, "
        f"{shape.num_params() / 1e9:.2f} B parameters; shape from {shape.source}",
        f"   tokenizer: {shape.tokenizer_note}",
        f"   W2 = 8 streams x 512 tokens, W3 = 1 stream x 256 tokens; {describe(args.repeats, args.max_tokens)}",
        f"   threads {threads}; KV cache {kv_gib} GiB (polyrunner, vLLM); vLLM max_num_batched_tokens "
        f"{VLLM_MAX_NUM_BATCHED_TOKENS}",
        f"   streaming-read bandwidth {bw / 1e9:.1f} GB/s ({threads} threads, median of {passes} passes "
        f"over 1 GiB: {bw_before['bytes_per_s'] / 1e9:.1f} before, {bw_after['bytes_per_s'] / 1e9:.1f} after "
        f"the rounds); CPU flags: {flags}",
        f"   bw used = read/token x W3 tok/s / {bw / 1e9:.1f} GB/s; read/token = the file's weights less the "
        f"token embedding, plus the LM head",
        f"   {time.strftime('%Y-%m-%d %H:%M', time.gmtime(t0))}-{time.strftime('%H:%M', time.gmtime())} UTC, "
        f"load average {', '.join(f'{x:.1f}' for x in load_start)} at start, "
        f"{', '.join(f'{x:.1f}' for x in load_end)} at end",
    ]


def run(args, threads: int, flags: str, llama_python: Path | None, vllm_python: Path | None) -> int:
    """`compare.py --model`: per model (smallest first) write what is missing, measure the bandwidth, run
    the rounds, print the table; then every table again, the anchors' builds and the flags; `--json`."""
    names = list(rm.REAL_SHAPES) if args.model == ["all"] else list(args.model)
    resolved = [rm.resolve(n) for n in names]
    resolved.sort(key=lambda sf: sf[0].num_params())          # smallest first
    types = list(args.types)
    if llama_python is None and vllm_python is None:
        print("[compare] note: neither llama.cpp nor vLLM: polyrunner rows only", flush=True)
    out: dict[str, Any] = {"threads": threads, "cpu_flags": flags, "llama_cpp": _marker(llama_python),
                           "vllm": _marker(vllm_python), "argv": sys.argv, "models": {}}
    if args.max_tokens:
        print(f"[compare] SMOKE RUN: output tokens capped at {args.max_tokens}: not a measurement", flush=True)
    tables = []
    for shape, folder in resolved:
        if folder == rm.shape_dir(shape.name):
            ms = rm.ensure(shape, types, llama_python, keep_bf16_gguf=args.keep_bf16_gguf, threads=threads)
        else:
            ms = rm.existing(shape, folder, types)
        if not ms.files:
            msg = f"{shape.name}: skipped: " + "; ".join(f"{t}: {why}" for t, why in ms.skipped.items())
            print(f"[compare] {msg}", flush=True)
            tables.append(msg)
            out["models"][shape.name] = {"skipped": ms.skipped}
            continue
        kv_gib = kv_cache_gib(shape)
        jobs = build_jobs(ms, args, threads, llama_python, vllm_python, kv_gib)
        gguf_py = llama_cpp_tools(rm.ROOT) / "gguf-py" if set(ms.files) - {"bf16"} else None
        weights = {t: bandwidth.file_weight_bytes(p, gguf_py) for t, p in ms.files.items()}
        print(f"[compare] {shape.name}: {len(jobs)} jobs x {args.repeats} rounds; measuring the read bandwidth",
              flush=True)
        bw_before = bandwidth.read_bandwidth(threads)
        load_start, t0 = os.getloadavg(), time.time()
        run_rounds(jobs, args.repeats, timeout_s=args.job_timeout, log_dir=args.log_dir / shape.name)
        bw_after = bandwidth.read_bandwidth(threads)
        load_end = os.getloadavg()
        passes = bw_before["passes"] + bw_after["passes"]
        bw = statistics.median(passes)
        rows = []
        for job in jobs:
            s = summary(job)
            s.update(weights[job.file], path=job.path)
            rows.append(s)
        header = _header(shape, args, threads, flags, kv_gib, bw, bw_before, bw_after, len(passes),
                         (t0, load_start, load_end))
        text = model_table(rows, bw, flags, header)
        print(text, flush=True)
        tables.append(text)
        out["models"][shape.name] = {
            "shape": shape.config, "source": shape.source, "kv_cache_gib": kv_gib, "skipped": ms.skipped,
            "bandwidth": {"bytes_per_s": bw, "before": bw_before, "after": bw_after},
            "rows": rows, "runs": {job.label: job.runs for job in jobs},
            "load_avg": [load_start, load_end]}
        if args.delete_after and folder == rm.shape_dir(shape.name):
            print(f"[compare] --delete-after: removing {folder} ({rm.disk_use(folder) / 1e9:.1f} GB)", flush=True)
            shutil.rmtree(folder)
    if len(tables) > 1:
        print("\n\n".join(["", *tables]))
    print(f"llama.cpp: {out['llama_cpp']}\nvLLM: {out['vllm']}\nthreads {threads}; CPU flags: {flags}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0
