"""A mixture-of-experts model served offline by polyrunner (CPU backend) and by vLLM's CPU
engine, on the same folder, in one run: output tok/s at 1 and 32 concurrent requests.

    .venv/bin/python benchmarks/moe.py [--repeats 3] [--skip-vllm] [--out FILE]
    .venv/bin/python benchmarks/moe.py --gguf [--rounds 3] [--out FILE]

The model is a random-weight Mixtral of realistic proportions that fits a small machine
(hidden 1024, 12 layers, 32 experts, top-4, expert width 256, 16 q / 4 KV heads, bfloat16),
written once with transformers to ~/.cache/polyrunner/bench-moe (no tokenizer: both runners
take token-id prompts). vLLM runs in its own venv (benchmarks/compare.py creates it), by
this same file with `--inner vllm`. Each workload's prompts are 128 random token ids, 128
new tokens each, greedy, ignore_eos; the median of `--repeats` timed runs after a warm-up.

`--gguf`: the same shape as a random Q4_K_M GGUF (tests/quant_moe_gguf.py: Q4_K gate/up expert
stacks, Q6_K / Q4_K down, Q4_K attention and embedding, Q6_K head; ~0.25 GB), run by polyrunner with
its experts quantized (`quantization="gguf"`, the default for a .gguf) and dequantised (bfloat16, the
"moe" override `pr_moe`; float32, the reference), each in its own process, `--rounds` rounds
interleaved: decode tok/s (the time of 33 new tokens less that of 1, at 1 and 8 concurrent
requests of 128-token prompts) and the process's RSS after the runs (VmRSS, and its growth from
before the engine was made) against the file's size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FOLDER = Path.home() / ".cache" / "polyrunner" / "bench-moe"
SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=256, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=4, num_local_experts=32, num_experts_per_tok=4,
             max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False)
CONCURRENCY = (1, 32)
PROMPT_LEN, MAX_TOKENS = 128, 128


def prompts(n: int) -> list[list[int]]:
    """`n` prompts of PROMPT_LEN token ids, the same on every runner (a fixed LCG, no numpy needed)."""
    out, x = [], 12345
    for _ in range(n):
        row = []
        for _ in range(PROMPT_LEN):
            x = (1103515245 * x + 12345) % 2 ** 31
            row.append(3 + x % (SHAPE["vocab_size"] - 3))
        out.append(row)
    return out


def ensure_folder() -> Path:
    """The random-weight Mixtral folder (bfloat16 safetensors), written on first use."""
    if (FOLDER / "config.json").is_file():
        return FOLDER
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(**SHAPE, torch_dtype="bfloat16")
    model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(FOLDER)
    print(f"[moe] wrote {FOLDER}", flush=True)
    return FOLDER


def measure(generate, repeats: int) -> list[dict]:
    """Time `generate(prompts) -> output token count` per concurrency (median of `repeats`)."""
    generate(prompts(2))   # warm-up
    results = []
    for n in CONCURRENCY:
        batch = prompts(n)
        walls, ntok = [], 0
        for _ in range(repeats):
            start = time.perf_counter()
            ntok = generate(batch)
            walls.append(time.perf_counter() - start)
        wall = statistics.median(walls)
        results.append(dict(concurrency=n, wall_s=wall, walls=walls, output_tokens=ntok, output_tok_s=ntok / wall))
    return results


def run_polyrunner(repeats: int) -> list[dict]:
    from polyrunner import LLM, SamplingParams
    llm = LLM(str(FOLDER), backend="cpu", dtype="bfloat16", max_num_seqs=64, max_model_len=2048,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate(batch: list[list[int]]) -> int:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return measure(generate, repeats)


def run_vllm_inner(repeats: int) -> list[dict]:
    """Inside the vLLM venv."""
    n = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    llm = LLM(model=str(FOLDER), dtype="bfloat16", seed=0, max_model_len=2048, max_num_seqs=64,
              enable_prefix_caching=False, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)

    def generate(batch: list[list[int]]) -> int:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return measure(generate, repeats)


def run_vllm(repeats: int) -> list[dict]:
    sys.path.insert(0, str(HERE))
    from compare import ensure_vllm_venv
    python = ensure_vllm_venv()
    proc = subprocess.run([str(python), __file__, "--inner", "vllm", "--repeats", str(repeats)],
                          capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ---- quantized experts (--gguf) -----------------------------------------------------------

GGUF_FILE = FOLDER.parent / "bench-moe-gguf" / "moe-q4_k_m.gguf"
GGUF_VARIANTS = {"quantized": dict(quantization="gguf"), "dequantised bf16": dict(dtype="bfloat16"),
                 "dequantised f32": dict(dtype="float32")}
GGUF_CONCURRENCY, GGUF_NEW = (1, 8), 33


def ensure_gguf() -> Path:
    """The random Q4_K_M Mixtral of SHAPE's sizes, written on first use."""
    if GGUF_FILE.is_file():
        return GGUF_FILE
    sys.path.insert(0, str(HERE.parent / "tests"))
    from quant_moe_gguf import MoEShape, write_quant_moe_gguf
    shape = MoEShape(vocab=SHAPE["vocab_size"], hidden=SHAPE["hidden_size"], intermediate=SHAPE["intermediate_size"],
                     layers=SHAPE["num_hidden_layers"], experts=SHAPE["num_local_experts"],
                     top_k=SHAPE["num_experts_per_tok"], heads=SHAPE["num_attention_heads"],
                     kv_heads=SHAPE["num_key_value_heads"], context=4096)
    GGUF_FILE.parent.mkdir(parents=True, exist_ok=True)
    tmp = GGUF_FILE.with_suffix(".partial")
    write_quant_moe_gguf(tmp, shape)
    tmp.rename(GGUF_FILE)
    print(f"[moe] wrote {GGUF_FILE} ({GGUF_FILE.stat().st_size / 1e9:.2f} GB)", flush=True)
    return GGUF_FILE


def _rss() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
    return {k: int(v.split()[0]) * 1024 for k, v in fields.items()}


def run_gguf_inner(variant: str) -> dict:
    """One variant in this process: decode tok/s per concurrency, RSS before and after."""
    import torch  # noqa: F401 - imported before the baseline, as the engine would

    from polyrunner import LLM, SamplingParams
    before = _rss()["VmRSS"]
    llm = LLM(str(GGUF_FILE), backend="cpu", max_num_seqs=8, max_model_len=512, enable_prefix_caching=False,
              **GGUF_VARIANTS[variant])
    loaded = _rss()["VmRSS"]

    def wall(batch: list[list[int]], new: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return time.perf_counter() - start

    wall(prompts(2), 4)   # warm-up
    out = {"variant": variant, "quantization": llm.engine.quantization, "dtype": str(llm.engine.dtype)}
    for n in GGUF_CONCURRENCY:
        batch = prompts(n)
        decode = wall(batch, GGUF_NEW) - wall(batch, 1)
        out[f"decode_tok_s_{n}"] = n * (GGUF_NEW - 1) / decode
    rss = _rss()
    out.update(rss_before=before, rss_loaded=loaded, rss=rss["VmRSS"], rss_peak=rss["VmHWM"],
               file_bytes=GGUF_FILE.stat().st_size)
    return out


def run_gguf(rounds: int) -> list[dict]:
    """Every variant in its own process, `rounds` rounds interleaved."""
    ensure_gguf()
    results = []
    for r in range(rounds):
        for variant in GGUF_VARIANTS:
            proc = subprocess.run([sys.executable, __file__, "--inner", "gguf", "--variant", variant],
                                  capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"{variant} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
            results.append(dict(json.loads(lines[-1][len("RESULT "):]), round=r))
            print(f"[moe] round {r}: {results[-1]}", flush=True)
    return results


def gguf_table(results: list[dict]) -> str:
    """Medians per variant, as a text table."""
    file_bytes = results[0]["file_bytes"]
    lines = [f"# MoE GGUF, quantized vs dequantised experts ({platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores; flags: {cpu_flags()})",
             f"# model: {GGUF_FILE.name}, random Q4_K_M blocks of {SHAPE} ({file_bytes / 1e6:.0f} MB); "
             f"medians of {len(results) // len(GGUF_VARIANTS)} interleaved rounds, one process per run",
             "variant                decode tok/s @1   @8   RSS MB  RSS-before MB  peak MB  RSS-before / file"]
    for variant in GGUF_VARIANTS:
        rows = [r for r in results if r["variant"] == variant]
        med = {key: statistics.median(r[key] for r in rows)
               for key in ("decode_tok_s_1", "decode_tok_s_8", "rss", "rss_before", "rss_peak")}
        grown = med["rss"] - med["rss_before"]
        lines.append(f"{variant:<22} {med['decode_tok_s_1']:>15.1f} {med['decode_tok_s_8']:>5.1f} "
                     f"{med['rss'] / 1e6:>8.0f} {grown / 1e6:>14.0f} {med['rss_peak'] / 1e6:>8.0f} "
                     f"{grown / file_bytes:>18.2f}")
    return "\n".join(lines)


def cpu_flags() -> str:
    sys.path.insert(0, str(HERE))
    from compare import cpu_flags as flags
    return flags()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--gguf", action="store_true", help="quantized vs dequantised experts of a Q4_K_M GGUF")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inner", choices=["vllm", "gguf"], help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=list(GGUF_VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner == "vllm":
        print("RESULT " + json.dumps(run_vllm_inner(args.repeats)), flush=True)
        return
    if args.inner == "gguf":
        print("RESULT " + json.dumps(run_gguf_inner(args.variant)), flush=True)
        return
    if args.gguf:
        runs = run_gguf(args.rounds)
        text = gguf_table(runs)
        print(text)
        if args.out:
            args.out.write_text(text + "\n\n" + json.dumps(runs, indent=1) + "\n")
        return
    ensure_folder()
    results = {"polyrunner": run_polyrunner(args.repeats)}
    if not args.skip_vllm:
        results["vllm"] = run_vllm(args.repeats)
    lines = [f"# MoE offline ({platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
             f"flags: {cpu_flags()})", f"# model: Mixtral-shaped random weights {SHAPE}, bfloat16",
             "concurrency  " + "  ".join(f"{r:>12}" for r in results) + ("   ratio" if "vllm" in results else "")]
    for i, n in enumerate(CONCURRENCY):
        vals = [results[r][i]["output_tok_s"] for r in results]
        ratio = f"   {vals[0] / vals[1]:.2f}x" if len(vals) == 2 else ""
        lines.append(f"{n:>11}  " + "  ".join(f"{v:>12.1f}" for v in vals) + ratio)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n\n" + json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
