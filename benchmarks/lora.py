"""Multi-LoRA cost: decode throughput of the embedded SmolLM2-135M (bfloat16, CPU backend) at 32
concurrent requests with no adapter, one adapter for all, and 8 adapters of rank 16 mixed.

    .venv/bin/python benchmarks/lora.py [--repeats 3] [--skip-vllm] [--out FILE]

Adapters are random PEFT folders of rank 16 on every attention and MLP projection (written
once under ~/.cache/polyrunner/bench-lora by `polyrunner.lora.peft.save_adapter`: nothing but
shapes matters for speed). One engine per runner (`enable_lora=True, max_loras=8,
max_lora_rank=16`) serves all three workloads, so its figures share warm-up, kernels and machine
state; vLLM's CPU engine runs the same folder and adapters in its own venv (this file with
`--inner vllm`) as the anchor. Each workload: 32 prompts of 16 random token ids, 128 new tokens,
greedy, ignore_eos; output tok/s
is the median of `--repeats` timed runs after a warm-up. The target (issue 29): 8 mixed
adapters cost <= 25% of the no-adapter throughput.
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

import torch

HERE = Path(__file__).resolve().parent
FOLDER = Path.home() / ".cache" / "polyrunner" / "bench-lora"
# SmolLM2-135M's shapes
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 30, 9, 3, 64
SHAPES = {"q_proj": (HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
          "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM),
          "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
RANK, NUM_ADAPTERS, CONCURRENCY, PROMPT_LEN, MAX_TOKENS = 16, 8, 32, 16, 128


def ensure_adapters() -> list[Path]:
    """NUM_ADAPTERS random rank-16 PEFT folders for SmolLM2-135M, written on first use."""
    from polyrunner.lora.peft import LoRAWeights, save_adapter
    folders = []
    for i in range(NUM_ADAPTERS):
        folder = FOLDER / f"adapter{i}"
        folders.append(folder)
        if (folder / "adapter_model.safetensors").is_file():
            continue
        gen = torch.Generator().manual_seed(i)
        modules = {(layer, name): LoRAWeights(torch.randn(RANK, fan_in, generator=gen) * 0.02,
                                              torch.randn(out, RANK, generator=gen) * 0.02)
                   for layer in range(LAYERS) for name, (out, fan_in) in SHAPES.items()}
        save_adapter(folder, modules, RANK, 2 * RANK)
    return folders


def prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 49152, (PROMPT_LEN,), generator=gen).tolist()}
            for _ in range(CONCURRENCY)]


def measure(generate, repeats: int) -> dict[str, float]:
    """Median output tok/s of `repeats` runs (after one warm-up) of each workload: `generate(prompts,
    adapter index per prompt or None) -> output tokens`."""
    batch = prompts()
    workloads = {"0 adapters": None, "1 adapter for all": [0] * CONCURRENCY,
                 f"{NUM_ADAPTERS} adapters mixed": [i % NUM_ADAPTERS for i in range(CONCURRENCY)]}
    results = {}
    for name, which in workloads.items():
        rates = []
        for i in range(repeats + 1):
            start = time.perf_counter()
            ntok = generate(batch, which)
            if i:
                rates.append(ntok / (time.perf_counter() - start))
        results[name] = statistics.median(rates)
    return results


def run_polyrunner(folder: str, adapters: list[Path], repeats: int) -> dict[str, float]:
    from polyrunner import LLM, SamplingParams
    from polyrunner.lora.request import LoRARequest
    loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    llm = LLM(folder, dtype="bfloat16", max_num_seqs=CONCURRENCY, enable_prefix_caching=False, enable_lora=True,
              max_loras=NUM_ADAPTERS, max_lora_rank=RANK)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def generate(batch, which):
        requests = None if which is None else [loras[i] for i in which]
        outs = llm.generate(batch, params, use_tqdm=False, lora_request=requests)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return measure(generate, repeats)


def run_vllm_inner(folder: str, adapters: list[str], repeats: int) -> dict[str, float]:
    """Inside the vLLM venv: the same workloads on vLLM's CPU engine."""
    n = os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{n - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    loras = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(adapters)]
    llm = LLM(model=folder, dtype="bfloat16", seed=0, max_num_seqs=CONCURRENCY, enable_prefix_caching=False,
              enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)

    def generate(batch, which):
        requests = None if which is None else [loras[i] for i in which]
        outs = llm.generate(batch, params, use_tqdm=False, lora_request=requests)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return measure(generate, repeats)


def run_vllm(folder: str, adapters: list[Path], repeats: int) -> dict[str, float] | str:
    """vLLM's figures, or why there are none."""
    sys.path.insert(0, str(HERE))
    from compare import ensure_vllm_venv
    python = ensure_vllm_venv()
    proc = subprocess.run([str(python), __file__, "--inner", "vllm", "--repeats", str(repeats), "--folder", folder,
                           "--adapters", *map(str, adapters)], capture_output=True, text=True,
                          env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return "vLLM run failed: " + (proc.stdout + proc.stderr)[-1500:]
    return dict(json.loads(lines[-1][len("RESULT "):]))


def cpu_flags() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags |= {f for f in line.split(":")[1].split() if f.startswith(("amx", "avx512", "avx_vnni"))}
            break
    return " ".join(sorted(flags))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--inner", choices=["vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--adapters", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner == "vllm":
        print("RESULT " + json.dumps(run_vllm_inner(args.folder, args.adapters, args.repeats)), flush=True)
        return
    sys.path.insert(0, str(HERE))
    from compare import cpu_flags, model_folder
    folder, adapters = model_folder(), ensure_adapters()
    results: dict[str, dict[str, float] | str] = {"polyrunner": run_polyrunner(folder, adapters, args.repeats)}
    if not args.skip_vllm:
        results["vllm"] = run_vllm(folder, adapters, args.repeats)
    lines = [f"# benchmarks/lora.py, {time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores; CPU flags: {cpu_flags()}",
             f"# SmolLM2-135M bf16 (HF folder of the embedded model), {CONCURRENCY} requests x {MAX_TOKENS} new "
             f"tokens, {NUM_ADAPTERS} random rank-{RANK} adapters on q/k/v/o/gate/up/down, median of {args.repeats}"]
    for runner, res in results.items():
        if isinstance(res, str):
            lines.append(f"{runner}: {res}")
            continue
        base = res["0 adapters"]
        for name, rate in res.items():
            lines.append(f"{runner:>10} {name:>20}: {rate:8.1f} out tok/s  ({rate / base:.2f}x of 0 adapters)")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
