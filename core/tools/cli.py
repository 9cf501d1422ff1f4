"""`polyrunner` command line: generate, chat, backends, serve (and plugin-added commands)."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default=None, help="backend name (default: best available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many devices (processes; several hosts: torchrun)")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help='speculative decoding as JSON (vLLM\'s), e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')


def _make_llm(args: argparse.Namespace):
    from polyrunner.llm import LLM
    return LLM(model=args.model, backend=args.backend, dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               kv_cache_memory_bytes=args.kv_cache_memory_bytes, enforce_eager=args.enforce_eager,
               seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
               speculative_config=args.speculative_config)


def _sampling(args: argparse.Namespace):
    from polyrunner.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)


def cmd_generate(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    llm = _make_llm(args)
    prompts = args.prompt or ["The capital of France is"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, _sampling(args), use_tqdm=True)
    elapsed = time.perf_counter() - t0
    n_tokens = 0
    for out in outs:
        if out.error:
            print(f"[error] {out.error}", file=sys.stderr)
            continue
        n_tokens += len(out.outputs[0].token_ids)
        print(f"--- {out.prompt!r}\n{out.prompt}{out.outputs[0].text}")
    print(f"{len(outs)} prompts, {n_tokens} tokens in {elapsed:.2f} s "
          f"({n_tokens / max(elapsed, 1e-9):.1f} tokens/s); load {t0 - start:.2f} s")
    return 0 if all(o.error is None for o in outs) else 1


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = _sampling(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    inputs = list(args.message) if args.message else None
    while True:
        if inputs is not None:
            if not inputs:
                return 0
            text = inputs.pop(0)
        else:
            try:
                text = input("> ")
            except EOFError:
                return 0
            if text.strip() in ("/exit", "/quit"):
                return 0
        messages.append({"role": "user", "content": text})
        reply = llm.chat(messages, params)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})


def cmd_backends(args: argparse.Namespace) -> int:
    from polyrunner.plugins import list_backends
    rows = [("name", "available", "reason", "device", "graph mode", "priority")]
    for info in list_backends():
        a = info.availability
        rows.append((info.name, "yes" if a.available else "no", a.reason or "-", a.device or "-",
                     info.graph_mode, str(info.priority)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyrunner", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    _engine_args(g)
    _sampling_args(g, 64)
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="chat with the model (interactive, or one-shot with --message)")
    _engine_args(c)
    _sampling_args(c, 256)
    c.add_argument("--message", action="append", help="one-shot user message (repeatable)")
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=cmd_chat)
    b = sub.add_parser("backends", help="list backends and whether they are available")
    b.set_defaults(func=cmd_backends)
    for extra in _extra_commands():
        extra(sub)
    return parser


def _extra_commands():
    """Sub-commands living in their own modules (conformance, bench, serve) when present."""
    import importlib
    for mod in ("polyrunner.tools.conformance.cli", "polyrunner.tools.bench.cli", "polyrunner.tools.serve.cli"):
        try:
            yield importlib.import_module(mod).add_parser
        except ImportError:
            continue


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"polyrunner: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
