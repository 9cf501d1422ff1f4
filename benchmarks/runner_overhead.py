"""Per-step host overhead of the runner, isolated with a no-op model.

The model returns zero hidden states and fixed logits, so a step's time is the
host path: scheduling, slot-state update, input preparation, sampling
bookkeeping and output processing. Reported in microseconds per step at 1, 32
and 256 running decode requests. The measurement lives in
`polyrunner.tools.bench.overhead` (also `polyrunner bench --workload overhead`).

    python benchmarks/runner_overhead.py [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import argparse

from polyrunner.tools.bench.overhead import make_folder, measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 32, 256])
    args = parser.parse_args()
    folder = make_folder()
    print(f"{'running decode requests':>24}  {'host us/step':>12}")
    for n in args.batch:
        print(f"{n:>24}  {measure(n, args.steps, folder, args.repeats):>12.1f}")


if __name__ == "__main__":
    main()
