"""`polyrunner` command line: generate, chat, backends, serve (and plugin-added commands)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from polyrunner.tools.engine_args import (
    HelpFormatter,
    add_chat_template_arg,
    add_engine_args,
    engine_kwargs,
    load_chat_template,
)


def _make_llm(args: argparse.Namespace):
    kwargs = engine_kwargs(args)
    logging.getLogger(__name__).info(   # the first line a user sees, before seconds of imports
        "starting: model %s, backend %s; importing torch", kwargs.get("model") or "(the embedded default)",
        kwargs.get("backend") or "(the best available)")
    from polyrunner.llm import LLM
    return LLM(**kwargs)


def _sampling(args: argparse.Namespace):
    from polyrunner.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate per output")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens whose "
                   "probabilities add up to this; 1: all tokens")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 or -1: all")
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of each request's sampling (default: None, the engine's --seed stream)")


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
    template = load_chat_template(args.chat_template)   # a bad path fails before the model loads
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
        try:
            reply = llm.chat(messages, params, use_tqdm=False, chat_template=template)[0].outputs[0].text
        except Exception as exc:   # the template's raise_exception, an undefined variable, ...
            if type(exc).__module__.startswith("jinja2"):
                raise ValueError(f"the chat template cannot render these messages: {exc}") from None
            raise
        print(reply)
        messages.append({"role": "assistant", "content": reply})


def cmd_backends(args: argparse.Namespace) -> int:
    from polyrunner.plugins import list_backends
    rows = [("name", "available", "reason", "device", "graph mode", "priority")]
    fixes: list[str] = []
    for info in list_backends():
        a = info.availability
        rows.append((info.name, "yes" if a.available else "no", a.reason or "-", a.device or "-",
                     info.graph_mode, str(info.priority)))
        if a.fix:
            fixes.append(f"  {info.name}: {a.fix}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    if fixes:
        print("\nto fix:")
        print("\n".join(fixes))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyrunner", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                        help="print polyrunner's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts", formatter_class=HelpFormatter,
                       description="Generate text for one or more prompts (vLLM's LLM.generate).")
    add_engine_args(g)
    _sampling_args(g, 64)
    g.add_argument("--prompt", action="append",
                   help="prompt text (repeatable; default: 'The capital of France is')")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="chat with the model (interactive, or one-shot with --message)",
                       formatter_class=HelpFormatter,
                       description="Chat with the model through its chat template (vLLM's LLM.chat); "
                                   "/exit or end of input stops.")
    add_engine_args(c)
    add_chat_template_arg(c)
    _sampling_args(c, 256)
    c.add_argument("--message", action="append",
                   help="one-shot user message (repeatable; default: read messages from the terminal)")
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=cmd_chat)
    b = sub.add_parser("backends", help="list backends and whether they are available",
                       formatter_class=HelpFormatter)
    b.set_defaults(func=cmd_backends)
    for extra in _extra_commands():
        extra(sub)
    for p in sub.choices.values():
        _add_log_level(p)
    return parser


def _add_log_level(p: argparse.ArgumentParser) -> None:
    """`--log-level` on a subcommand (one definition for all of them, plugin-added ones included)."""
    from polyrunner.logging_setup import LOG_LEVELS
    if any("--log-level" in a.option_strings for a in p._actions):
        return
    default = p.get_default("default_log_level") or "info"
    p.add_argument("--log-level", default=None, choices=list(LOG_LEVELS),
                   help=f"log level of polyrunner's messages (default: $POLYRUNNER_LOGGING_LEVEL, else {default})")


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("polyrunner")
    except Exception:   # not installed (a source checkout on sys.path)
        from polyrunner import __version__
        return __version__


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
        from polyrunner.logging_setup import configure_logging
        level = configure_logging(getattr(args, "log_level", None), getattr(args, "default_log_level", None) or "info")
        args.log_level = logging.getLevelName(level).lower()   # what --log-level resolved to (serve: uvicorn's)
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"polyrunner: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
