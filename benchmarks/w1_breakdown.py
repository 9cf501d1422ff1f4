"""Where W1's time goes on the CPU backend: prefill linears, decode linears, attention, the rest.

    .venv/bin/python benchmarks/w1_breakdown.py [--dtype bfloat16|quantized] [--workload w1] [--model PATH]

Two runs of the workload in one process, after a warm-up each:
1. as served (CPU graphs on): wall time split into steps with prompt tokens ("prefill": prefill
   and mixed steps), decode-only steps, logits + sampling, and the host (everything else:
   scheduling, input preparation, output bookkeeping);
2. `enforce_eager` (every op called from Python, so each can be timed): inside prefill and decode
   steps, the time in the linears (`PackedLinear`/`QuantLinear`), in attention, and the rest
   (fused norms, rotary, SiLU, embedding). The decode split is that of eager steps; in run 1 the
   same kernels run inside graph replays; the replays of the smallest and largest graphs are
   then timed kernel by kernel (`graphs.replay_profile`).
Prints both tables with the CPU flags; environment variables (e.g. `POLYRUNNER_CPU_LINEAR=onednn`)
apply as usual, so kernel choices can be compared run against run.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from polyrunner.tools.bench.host import format_host, host_info
from polyrunner.tools.bench.run import _generate, make_llm
from polyrunner.tools.bench.workloads import make_workload


class Clock:
    """Accumulates seconds per category while `phase` names the step kind in progress."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.phase = "other"

    def wrap(self, fn, name: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[f"{self.phase} {name}"] += time.perf_counter() - start
        return timed


def instrument(llm, clock: Clock, ops: bool) -> None:
    """Time the executor's run / compute_logits / sample (and with `ops` the linears and attention)."""
    ex = llm.engine.runner.executor
    run = ex.run

    def step(inputs):
        meta = inputs.attn
        clock.phase = "decode" if meta.num_decodes == meta.num_reqs else "prefill"
        start = time.perf_counter()
        try:
            return run(inputs)
        finally:
            clock.total[f"{clock.phase} step"] += time.perf_counter() - start
    ex.run = step
    ex.compute_logits = clock.wrap(ex.compute_logits, "logits")
    ex.sample = clock.wrap(ex.sample, "sample")
    if not ops:
        return
    from polyrunner.backends.cpu.packed_linear import PackedLinear
    from polyrunner.backends.cpu.quant_linear import QuantLinear
    from polyrunner.backends.cpu.quant_runs import QuantRunsLinear
    for module in ex.model.modules():
        if isinstance(module, (PackedLinear, QuantLinear, QuantRunsLinear)):   # runs go through forward_into: once
            module.forward = clock.wrap(module.forward, "linear")
    for module in ex.model.modules():   # the attention modules hold the backend's op as `attn_op`
        if callable(getattr(module, "attn_op", None)):
            module.attn_op = clock.wrap(module.attn_op, "attention")


def measure(eager: bool, workload: str, model: str | None = None, **options) -> tuple[float, dict[str, float], str]:
    llm = make_llm(model, eager, **options)
    w = make_workload(workload)
    _generate(llm, w.prompts[:4], 8)   # warm-up
    clock = Clock()
    instrument(llm, clock, ops=eager)
    wall, _, _ = _generate(llm, w.prompts, w.max_tokens)
    profile = "" if eager else replay_table(llm)
    llm.shutdown()
    return wall, dict(clock.total), profile


def replay_table(llm, repeats: int = 20) -> str:
    """Microseconds per kernel in replays of the smallest and largest CPU graphs, with the
    context the last step left in the static inputs (`graphs.replay_profile`)."""
    from polyrunner.backends.cpu import kernels
    from polyrunner.backends.cpu.graphs import replay_profile
    ex, lib = llm.engine.runner.executor, kernels.paged_attention_kernel()
    graphs = getattr(ex, "graphs", {})
    lines = []
    for B in sorted({min(graphs), max(graphs)} if graphs else ()):
        totals: dict[str, float] = defaultdict(float)
        for name, _args, us in replay_profile(lib, graphs[B].replay, repeats):
            totals[name.removeprefix("pr_")] += us
        lines.append(f"  graph {B:3d}: {sum(totals.values()):8.0f} us = " + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])))
    return "\n".join(["replays (us per kernel, summed over layers):", *lines]) if lines else ""


def table(title: str, wall: float, parts: dict[str, float]) -> str:
    lines = [f"{title}: wall {wall:.2f} s"]
    for phase in ("prefill", "decode"):
        step = parts.get(f"{phase} step", 0.0)
        lin, att = parts.get(f"{phase} linear", 0.0), parts.get(f"{phase} attention", 0.0)
        line = f"  {phase:8s} steps {step:6.2f} s ({100 * step / wall:4.1f}%)"
        if lin or att:
            line += f"  = linear {lin:6.2f} s, attention {att:5.2f} s, rest {step - lin - att:5.2f} s"
        lines.append(line)
    logits = sum(v for k, v in parts.items() if k.endswith(" logits"))
    sample = sum(v for k, v in parts.items() if k.endswith(" sample"))
    host = wall - sum(parts.get(f"{p} step", 0.0) for p in ("prefill", "decode")) - logits - sample
    lines.append(f"  logits {logits:.2f} s, sampling {sample:.2f} s, host (scheduling, inputs, outputs) {host:.2f} s")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16",
                    help='"quantized": the GGUF blocks as they are (what `LLM()` runs by default)')
    ap.add_argument("--workload", default="w1", choices=["w1", "w2", "w3"])
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded model), "
                    "e.g. a real-shape model of benchmarks/realistic_models.py")
    args = ap.parse_args()
    print(format_host(host_info()))
    options = {"model": args.model} if args.model else {}
    options.update({} if args.dtype == "quantized" else {"dtype": args.dtype})
    wall, parts, profile = measure(False, args.workload, **options)
    print(table(f"{args.workload} as served (graphs)", wall, parts))
    print(profile)
    wall, parts, _ = measure(True, args.workload, **options)
    print(table(f"{args.workload} eager (per-op split)", wall, parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
