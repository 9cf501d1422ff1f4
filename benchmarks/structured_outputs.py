"""Per-step cost of structured outputs' token bitmask on the CPU backend, against
an unconstrained decode step measured in the same run.

    .venv/bin/python benchmarks/structured_outputs.py [--batch 32] [--tokens 64] [--repeats 3]

Workload: `--batch` chat prompts on the embedded SmolLM2-135M (as `LLM()` runs
it), greedy. Unconstrained: exactly `--tokens` tokens each (ignore_eos); its
decode step time is (t(tokens) - t(1)) / (tokens - 1), prefill cancelled out.
Constrained: the same prompts, each with its own JSON schema (compiled before
the timed runs; the cache makes later compiles free). The mask's host work
(catching the matchers up with the last token, xgrammar's batched fill, the
upload) and its application to the logits (unpack + masked_fill) are timed
inside the step; both are reported per step and as a fraction of the
unconstrained step. Medians over --repeats runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor()
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags)


class Timer:
    """Wraps a function; accumulates its wall time and call count."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.fn = owner, name, getattr(owner, name)
        self.seconds, self.calls = 0.0, 0
        timer = self

        def wrapped(*args, **kw):
            t0 = time.perf_counter()
            try:
                return timer.fn(*args, **kw)
            finally:
                timer.seconds += time.perf_counter() - t0
                timer.calls += 1
        setattr(owner, name, wrapped)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    import polyrunner.sample.sampler as sampler_mod
    from polyrunner import LLM, SamplingParams
    from polyrunner.sample.state import SamplingState
    from polyrunner.sampling_params import StructuredOutputsParams
    from test_structured_outputs import make_schema

    B, T = args.batch, args.tokens
    llm = LLM(max_model_len=512, max_num_seqs=B, max_num_batched_tokens=4096)
    tok = llm.get_tokenizer()
    schemas = [make_schema(i) for i in range(B)]
    prompts = [tok.apply_chat_template(
                   [{"role": "user", "content": f"A JSON object with {', '.join(s['properties'])}."}],
                   add_generation_prompt=True, tokenize=False) for s in schemas]
    build = Timer(SamplingState, "_grammar_bitmask")
    apply = Timer(sampler_mod, "apply_token_bitmask")

    def run(params) -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    free = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    constrained = [SamplingParams(temperature=0.0, max_tokens=T, structured_outputs=StructuredOutputsParams(json=s))
                   for s in schemas]
    run(free(T))
    run(constrained)   # warm-up; compiles every schema once
    step_free, step_cons, build_ms, apply_ms, steps, tokens = [], [], [], [], [], []
    for _ in range(args.repeats):
        t_full, _ = run(free(T))
        t_one, _ = run(free(1))
        step_free.append((t_full - t_one) / (T - 1) * 1e3)
        build.reset()
        apply.reset()
        t_cons, n_tok = run(constrained)
        n_steps = max(build.calls, 1)
        step_cons.append((t_cons - t_one) / max(n_steps - 1, 1) * 1e3)
        build_ms.append(build.seconds / n_steps * 1e3)
        apply_ms.append(apply.seconds / max(apply.calls, 1) * 1e3)
        steps.append(n_steps)
        tokens.append(n_tok)
    med = statistics.median
    free_ms = med(step_free)
    fig = {
        "batch": B, "max_tokens": T, "cpu_flags": cpu_flags(), "threads": os.cpu_count(),
        "unconstrained_step_ms": round(free_ms, 2),
        "constrained_step_ms": round(med(step_cons), 2),
        "mask_build_ms_per_step": round(med(build_ms), 3),
        "mask_apply_ms_per_step": round(med(apply_ms), 3),
        "mask_total_vs_unconstrained_step": round((med(build_ms) + med(apply_ms)) / free_ms, 3),
        "constrained_steps": med(steps), "constrained_tokens": med(tokens),
    }
    print(f"batch {B}, greedy, CPU flags: {fig['cpu_flags']}")
    print(f"  unconstrained decode step   {fig['unconstrained_step_ms']:8.2f} ms")
    print(f"  constrained decode step     {fig['constrained_step_ms']:8.2f} ms  (JSON schemas, "
          f"{fig['constrained_tokens']} tokens in {fig['constrained_steps']} steps: "
          f"{fig['constrained_tokens'] / fig['constrained_steps']:.1f} rows per step on average, as requests end)")
    print(f"  mask: build (sync+fill+up)  {fig['mask_build_ms_per_step']:8.3f} ms/step")
    print(f"  mask: apply to logits       {fig['mask_apply_ms_per_step']:8.3f} ms/step")
    print(f"  mask total / unconstrained step = {fig['mask_total_vs_unconstrained_step']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2))


if __name__ == "__main__":
    main()
