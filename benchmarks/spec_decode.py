"""Speculative decoding (ngram) vs none on a repetitive workload, one run.

The embedded SmolLM2-135M-Instruct is asked to repeat texts and code (its output
largely copies the prompt, where prompt lookup finds the drafts). Both engines
run the same prompts, greedy, in alternating timed rounds after a warm-up; the
report gives output tokens/s of each (median round), their ratio, the acceptance
rate and mean acceptance length, that outputs are identical, and the host's CPU
flags. Timings on a shared machine are noisy: compare the ratio, not the rates.

    .venv/bin/python benchmarks/spec_decode.py [--k 4] [--requests 4] [--max-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from polyrunner import LLM, SamplingParams
from polyrunner.tools.bench.host import host_info

TEXTS = [
    "The committee met on Tuesday to review the budget. After a long discussion, the members agreed to fund "
    "the new library, to repair the old bridge before winter, and to hire two more teachers for the school.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is lower, "
    "so water boils at a lower temperature, and cooking pasta takes longer in the mountains.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
]


def prompts(llm: LLM, n: int) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for i in range(n):
        text = TEXTS[i % len(TEXTS)]
        chat = tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                                       add_generation_prompt=True)
        out.append({"prompt": chat, "prompt_token_ids": tok.encode(chat, add_special_tokens=False)})
    return out


def timed(llm: LLM, batch: list[dict], params: SamplingParams) -> tuple[float, int, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ids = [o.outputs[0].token_ids for o in outs]
    return wall, sum(map(len, ids)), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    common = dict(dtype=args.dtype, max_num_seqs=max(args.requests, 1), enable_prefix_caching=False)
    engines = {"baseline": LLM(**common), "ngram": LLM(**common, speculative_config=spec_cfg)}
    batch = prompts(engines["baseline"], args.requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    for llm in engines.values():   # warm-up
        timed(llm, batch, params)
    stats = engines["ngram"].engine.speculative_stats()
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            wall, n_out, outputs[name] = timed(llm, batch, params)
            rates[name].append(n_out / wall)
    drafts, draft_tokens, accepted = (b - a for a, b in zip(before, (stats.num_drafts, stats.num_draft_tokens,
                                                                      stats.num_accepted_tokens)))
    base, spec = statistics.median(rates["baseline"]), statistics.median(rates["ngram"])
    result = {
        "host": host_info(), "dtype": args.dtype, "requests": args.requests, "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.k, "rounds": args.rounds,
        "baseline_output_tok_s": round(base, 1), "ngram_output_tok_s": round(spec, 1),
        "speedup": round(spec / base, 2),
        "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else 0.0,
        "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else 1.0,
        "identical_outputs": outputs["baseline"] == outputs["ngram"],
        "all_rates": {k: [round(r, 1) for r in v] for k, v in rates.items()},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
