"""The engine options every subcommand shares (generate, chat, serve, bench), defined once.

`add_engine_args(parser)` adds them with vLLM's names, meanings and defaults;
`engine_kwargs(args)` turns the parsed namespace into `LLM(...)` / `AsyncLLM(...)`
keyword arguments; `resolve_model(args)` merges the positional model with `--model`.
A subcommand that takes only some of them passes `only=` (the destinations).
"""

from __future__ import annotations

import argparse
import codecs
import json
from typing import Any, get_args

from polyrunner.config import (
    LORA_RANKS,
    CacheConfig,
    DType,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    default_of,
)

__all__ = ["ENGINE_ARGS", "add_engine_args", "add_model_args", "engine_kwargs", "resolve_model",
           "add_chat_template_arg", "load_chat_template", "HelpFormatter"]

class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; every option's help ends with its default (unless it states one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower():
            return text
        return super()._get_help_string(action)


_DTYPES = list(get_args(DType))

# dest -> (flags, add_argument keyword arguments); the dest is also the LLM keyword argument
ENGINE_ARGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "backend": (("--backend",), dict(default=None, help="registered backend name (default: the best available; "
                                                        "see `polyrunner backends`)")),
    "dtype": (("--dtype",), dict(default=default_of(ModelConfig, "dtype"), choices=_DTYPES,
                                 help="weight and activation dtype; auto: the checkpoint's, or what the backend "
                                      "runs fastest")),
    "quantization": (("--quantization", "-q"), dict(default=None, choices=["gguf"],
                     help="weight quantization method; None: a quantized (GGUF) checkpoint runs quantized when the "
                          "backend executes its format and --dtype is auto, dequantised otherwise")),
    "max_model_len": (("--max-model-len",), dict(type=int, default=None,
                      help="model context length, prompt plus output (default: the model's own limit)")),
    "tokenizer": (("--tokenizer",), dict(default=None,
                  help="tokenizer folder (default: the model's own)")),
    "seed": (("--seed",), dict(type=int, default=default_of(ModelConfig, "seed"),
             help="random seed for requests without their own")),
    "max_num_seqs": (("--max-num-seqs",), dict(type=int, default=None,
                     help="most sequences in one batch (iteration) (default: the backend's, vLLM's by device: "
                          "CUDA 1024 from 70 GiB of memory, else 256; elsewhere "
                          f"{default_of(SchedulerConfig, 'max_num_seqs')})")),
    "max_num_batched_tokens": (("--max-num-batched-tokens",),
                               dict(type=int, default=None,
                               help="most tokens computed in one iteration (default: the backend's, vLLM's by "
                                    "device: CUDA 16384 (serve: 8192) from 70 GiB of memory, else 8192 (serve: "
                                    f"2048); elsewhere {default_of(SchedulerConfig, 'max_num_batched_tokens')})")),
    "block_size": (("--block-size",), dict(type=int, default=None,
                   help="tokens per KV-cache block (default: the backend's choice, else "
                        f"{default_of(CacheConfig, 'block_size')})")),
    "gpu_memory_utilization": (("--gpu-memory-utilization",),
                               dict(type=float, default=default_of(CacheConfig, "memory_utilization"),
                               help="share (0, 1] of the device's memory the KV cache may use, when "
                                    "--kv-cache-memory-bytes is not given (vLLM's name; every backend)")),
    "kv_cache_memory_bytes": (("--kv-cache-memory-bytes",), dict(type=int, default=None,
                              help="KV-cache size in bytes (overrides --gpu-memory-utilization)")),
    "enable_prefix_caching": (("--enable-prefix-caching",), dict(action=argparse.BooleanOptionalAction,
                              default=default_of(CacheConfig, "enable_prefix_caching"),
                              help="reuse the KV cache of prompts' shared prefixes")),
    "enforce_eager": (("--enforce-eager",), dict(action="store_true",
                      help="run the model eagerly: no graph capture or compilation")),
    "cudagraph_mode": (("--cudagraph-mode",), dict(default=None, choices=["FULL", "FULL_DECODE_ONLY", "NONE"],
                       help="graphs a graph-capturing backend captures (vLLM's compilation_config.cudagraph_mode): "
                            "FULL (decode and mixed prefill+decode steps), FULL_DECODE_ONLY, NONE (default: the "
                            "backend's own, FULL on CUDA with Triton attention)")),
    "tensor_parallel_size": (("--tensor-parallel-size", "-tp"),
                             dict(type=int, default=default_of(ParallelConfig, "tensor_parallel_size"),
                             help="shard the model over this many devices (processes; several hosts: torchrun)")),
    "data_parallel_size": (("--data-parallel-size", "-dp"),
                           dict(type=int, default=default_of(ParallelConfig, "data_parallel_size"),
                           help="engine replicas behind this server, each with its own tensor-parallel group; "
                                "requests go to the least loaded")),
    "distributed_executor_backend": (("--distributed-executor-backend",), dict(default=None, choices=["mp", "ray"],
                                     help="how tensor-parallel workers start: mp (processes on this host; "
                                          "default) or ray (Ray actors; pip install 'polyrunner[ray]')")),
    "speculative_config": (("--speculative-config",), dict(type=json.loads, default=None,
                           help='speculative decoding as JSON (vLLM\'s), e.g. '
                                '\'{"method": "ngram", "num_speculative_tokens": 4}\'')),
    "enable_lora": (("--enable-lora",), dict(action=argparse.BooleanOptionalAction, default=False,
                    help="serve LoRA adapters next to the base model (vLLM's; requests name an adapter with "
                         "`lora_request`, or, served, as their `model`)")),
    "max_loras": (("--max-loras",), dict(type=int, default=default_of(LoRAConfig, "max_loras"),
                  help="most distinct adapters in one batch (device-resident adapter slots); with --enable-lora")),
    "max_lora_rank": (("--max-lora-rank",), dict(type=int, default=default_of(LoRAConfig, "max_lora_rank"),
                      choices=list(LORA_RANKS), help="highest adapter rank the slots hold; with --enable-lora")),
    "max_cpu_loras": (("--max-cpu-loras",), dict(type=int, default=None,
                      help="adapters kept read in host memory, >= --max-loras (default: --max-loras); with "
                           "--enable-lora")),
    "trust_remote_code": (("--trust-remote-code",), dict(action="store_true",
                          help="accepted for vLLM compatibility and not needed: polyrunner runs no model code "
                               "from the hub (its model implementations are its own)")),
}

def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model, as vLLM takes it: `polyrunner CMD MODEL`, or `--model MODEL`."""
    text = ("a Hugging Face folder, a .gguf file, or a Hugging Face name (org/name: the local Hugging Face cache, "
            "else a download)")
    parser.add_argument("model", nargs="?", default=None, help=text + " (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the same as the positional MODEL (default: the embedded SmolLM2-135M-Instruct)")


def add_engine_args(parser: argparse.ArgumentParser, only: set[str] | None = None) -> None:
    """The model arguments plus every engine option (or those in `only`)."""
    add_model_args(parser)
    for dest, (flags, kwargs) in ENGINE_ARGS.items():
        if only is None or dest in only:
            parser.add_argument(*flags, dest=dest, **kwargs)


def resolve_model(args: argparse.Namespace) -> str | None:
    """The one model named by the positional argument and/or `--model`; ValueError when
    both are given and differ. Stores it in `args.model` and returns it."""
    positional, option = getattr(args, "model", None), getattr(args, "model_option", None)
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"the model is given twice, differently: positional {positional!r} and --model {option!r}; "
                         "give one")
    args.model = positional if positional is not None else option
    return args.model


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM` / `AsyncLLM` keyword arguments from the engine options the parser had
    (`model` included; `LLM` logs that `trust_remote_code` is not needed)."""
    kwargs: dict[str, Any] = {"model": resolve_model(args)}
    for dest in ENGINE_ARGS:
        if hasattr(args, dest):
            kwargs[dest] = getattr(args, dest)
    return kwargs


def add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", default=None,
                        help="the chat template: a file path, or the template itself (vLLM's rule: a value that "
                             "names no file and holds '{', '}' or a newline is the template) (default: the "
                             "model's own)")


def load_chat_template(value: str | None) -> str | None:
    """vLLM's `load_chat_template`: the file's text when `value` opens as a file; else
    `value` itself (escapes such as \\n decoded) when it looks like a Jinja template;
    else a ValueError saying the path could not be opened."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"The supplied chat template ({value}) looks like a file path, but it failed to be "
                             f"opened. Reason: {exc}") from exc
        return codecs.decode(value, "unicode_escape")
