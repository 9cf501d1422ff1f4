"""`polyrunner serve`: the OpenAI-compatible HTTP server.

    polyrunner serve                                   # embedded model on http://127.0.0.1:8000
    polyrunner serve ./my-llama --port 9000 --api-key secret --max-waiting 256
    polyrunner serve Org/Model --gpu-memory-utilization 0.5 --no-enable-prefix-caching
    polyrunner serve ./my-llama --enable-lora --lora-modules sql=./sql-lora chat=./chat-lora

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics, /tokenize, /detokenize, /v1/load_lora_adapter,
/v1/unload_lora_adapter. A LoRA adapter is served under its name: a request
whose `model` is that name runs with it. The engine runs in its own process
(`--no-engine-process`: in a thread of the server).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from polyrunner.tools.engine_args import (
    HelpFormatter,
    add_chat_template_arg,
    add_engine_args,
    engine_kwargs,
    load_chat_template,
)
from polyrunner.tools.serve import envs
from polyrunner.tools.serve.lora import LoRAModulesAction


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description=__doc__, formatter_class=HelpFormatter)
    add_engine_args(p)
    add_chat_template_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $POLYRUNNER_API_KEY; unset: open)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: the model's file or folder name, or its Hugging Face "
                        "name as given)")
    p.add_argument("--lora-modules", nargs="+", action=LoRAModulesAction, default=None, metavar="ENTRY",
                   help="LoRA adapters served from the start (with --enable-lora), each as name=path or as JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (vLLM's forms); a request "
                        "names one as its `model`")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="answer 503 + Retry-After when a request's sequences (prompts x n) would make more than "
                        "this many wait for a slot (default: no cap)")
    p.add_argument("--max-prompts-per-request", type=int, default=None,
                   help="answer 400 to a /v1/completions request with more prompts than this (default: 256)")
    p.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="answer 413 to a request body larger than this many bytes (default: 4 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds to let in-flight requests finish; then each gets a 503 "
                        "error (a stream: an error event, then [DONE]) and is aborted")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process, so the HTTP server and the engine never share a "
                        "GIL (default); --no-engine-process runs it in a thread of the server")
    p.add_argument("--data-parallel-routing", choices=["least_loaded", "cache_aware"], default="least_loaded",
                   help="with --data-parallel-size > 1, which replica takes a request: the least loaded (waiting + "
                        "running), or cache_aware: by a hash of the prompt's first block, so repeated prompts "
                        "find their prefix cache, unless that replica is much busier")
    p.add_argument("--prefault-kv-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="map the KV cache's pages in the background after start-up, so no step pays a first-touch "
                        "page fault (default; host-memory backends)")
    p.set_defaults(func=cmd_serve)


def default_model_name(model: str | None) -> str:
    """The name clients use by default: the file's stem or the folder's name; a
    Hugging Face name (org/name) as given, as vLLM does."""
    if model is None:
        from polyrunner.models.default_model import DEFAULT_MODEL_FILE
        return DEFAULT_MODEL_FILE.split(".")[0]
    from polyrunner.models.hub import is_hub_name
    if is_hub_name(model):
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or str(model)


def cmd_serve(args: argparse.Namespace) -> int:
    from polyrunner.engine.async_llm import AsyncLLM
    from polyrunner.tools.serve.api_server import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPTS_PER_REQUEST, build_app
    from polyrunner.tools.serve.launcher import make_server, run_server

    chat_template = load_chat_template(args.chat_template)   # a bad path fails before the model loads
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (LoRA is off without it)")
    api_key = args.api_key if args.api_key is not None else envs.API_KEY.get()
    log_level = getattr(args, "log_level", None) or "info"   # main() sets it from --log-level
    async_llm = AsyncLLM(**engine_kwargs(args), prefault_kv_cache=args.prefault_kv_cache,
                         engine_process=args.engine_process, routing=args.data_parallel_routing,
                         usage_context="OPENAI_API_SERVER")
    names = args.served_model_name or [default_model_name(args.model)]
    app = build_app(async_llm, served_model_names=names, api_key=api_key, max_waiting=args.max_waiting,
                    max_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES,
                    max_prompts_per_request=args.max_prompts_per_request or DEFAULT_MAX_PROMPTS_PER_REQUEST,
                    shutdown_timeout=args.shutdown_timeout, chat_template=chat_template,
                    lora_modules=args.lora_modules)
    server = make_server(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout,
                         log_level=log_level)
    try:
        code = run_server(server)
    except SystemExit:   # uvicorn exits when the app's start-up fails
        if app.state.startup_error is None:
            raise
        code = 1
    finally:
        async_llm.shutdown(0)
    if app.state.startup_error is not None:   # a --lora-modules adapter that would not load
        raise app.state.startup_error
    return code
