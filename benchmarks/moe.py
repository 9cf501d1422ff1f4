"""A mixture-of-experts model served offline by polyrunner (CPU backend) and by vLLM's CPU
engine, on the same folder, in one run: output tok/s at 1 and 32 concurrent requests.

    .venv/bin/python benchmarks/moe.py [--repeats 3] [--skip-vllm] [--out FILE]

The model is a random-weight Mixtral of realistic proportions that fits a small machine
(hidden 1024, 12 layers, 32 experts, top-4, expert width 256, 16 q / 4 KV heads, bfloat16),
written once with transformers to ~/.cache/polyrunner/bench-moe (no tokenizer: both runners
take token-id prompts). vLLM runs in its own venv (benchmarks/compare.py creates it), by
this same file with `--inner vllm`. Each workload's prompts are 128 random token ids, 128
new tokens each, greedy, ignore_eos; the median of `--repeats` timed runs after a warm-up.
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


def cpu_flags() -> str:
    sys.path.insert(0, str(HERE))
    from compare import cpu_flags as flags
    return flags()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--out", type=Path)
    p.add_argument("--inner", choices=["vllm"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner == "vllm":
        print("RESULT " + json.dumps(run_vllm_inner(args.repeats)), flush=True)
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
