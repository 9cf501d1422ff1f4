"""Run benchmark workloads on llama.cpp (llama-cpp-python's bindings); prints one JSON line each.

Runs inside the llama.cpp venv (see benchmarks/compare.py, which builds it and
calls this file); loads the workload definitions by path so every runner gets
exactly the same requests.

    python benchmarks/llama_cpp_workload.py --model FILE.gguf --workload w2 w3 [--threads 2] [--repeats 3]
                                            [--max-tokens N]

Every request of a workload is one sequence (slot) of one llama.cpp context,
and each step decodes every slot's next token in one `llama_decode` batch:
what llama-server does with `--parallel N` (its slots), without HTTP. W3 is
one slot. Greedy (argmax of each slot's logits), exactly max_tokens per
request (end-of-sequence ignored), prompts as token ids.

The model is loaded once (llama.cpp's defaults: mmap on), each workload gets its own context. A
`LOAD {json}` line gives the start-up (model load + the first workload's context: what `Llama(...)`
does) and the resident memory after it and at its peak (benchmarks/proc_stats.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time

import numpy as np

from proc_stats import LoadMeter, end_stats
from shared_workloads import capped, result, workloads


def load_model(model_path: str):
    """The llama.cpp model of `model_path` (default model parameters)."""
    import llama_cpp as L
    L.llama_backend_init()
    model = L.llama_model_load_from_file(model_path.encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp cannot load {model_path}")
    return model


class Slots:
    """One llama.cpp context with `n_seq` sequences decoded together, greedily."""

    def __init__(self, model, n_seq: int, n_ctx: int, threads: int) -> None:
        import llama_cpp as L
        self.L = L
        self.model = model
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, n_seq
        p.n_threads = p.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, p)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(max(512, n_seq), 0, 1)

    def close(self) -> None:
        """Free the context (the model stays loaded)."""
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits); at most 512 per call."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)).argmax())

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, list[list[int]]]:
        """(wall seconds, seconds to the first tokens, the tokens of each request)."""
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        items = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        if len(items) > 512:
            raise ValueError(f"{len(items)} prompt tokens: this harness prefills at most 512 in one batch")
        self._decode(items)
        last = {it[2]: i for i, it in enumerate(items) if it[3]}  # sequence -> its logits row
        out: list[list[int]] = [[] for _ in prompts]
        first = None
        for step in range(max_tokens):
            for s in range(len(prompts)):
                out[s].append(self._argmax(last[s]))
            if first is None:
                first = time.perf_counter() - start
            if step + 1 == max_tokens:
                break
            self._decode([(out[s][-1], len(p) + step, s, True) for s, p in enumerate(prompts)])
            last = {s: s for s in range(len(prompts))}
        return time.perf_counter() - start, first, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--workload", nargs="+", default=["w2", "w3"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=None, help="cap every workload's output tokens (smoke runs)")
    args = p.parse_args()
    wl = workloads()
    model = None
    for name in args.workload:
        w = capped(wl.make_workload(name), args.max_tokens)
        n_ctx = len(w.prompts) * (max(len(q) for q in w.prompts) + w.max_tokens + 16)
        t0 = time.perf_counter()
        if model is None:
            with LoadMeter() as meter:
                model = load_model(args.model)
                slots = Slots(model, len(w.prompts), n_ctx, args.threads)
            print("LOAD " + json.dumps(meter.stats()), flush=True)
        else:
            slots = Slots(model, len(w.prompts), n_ctx, args.threads)
        load_s = time.perf_counter() - t0
        slots.generate([q[:8] for q in w.prompts], 4)  # warm-up
        walls, ttfts, tokens = [], [], []
        for _ in range(args.repeats):
            wall, ttft, tokens = slots.generate(w.prompts, w.max_tokens)
            walls.append(wall)
            ttfts.append(ttft)
        res = result("llama.cpp", w, walls, ttfts, sum(len(t) for t in tokens), load_s=load_s, threads=args.threads,
                     first_tokens=tokens[0][:16], **end_stats())
        print("RESULT " + json.dumps(res), flush=True)
        slots.close()


if __name__ == "__main__":
    main()
