"""vLLM's `LLM(...)` / engine arguments that make no difference to polyrunner.

Each one is accepted with the values polyrunner honours as they are (vLLM's default
and its equivalents); any other value is a ValueError naming the argument and why,
never silently ignored. An argument neither `LLM` nor this table knows is a
TypeError naming it, in Python's (and vLLM's `EngineArgs`') wording.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Arg:
    ok: Callable[[Any], bool]
    accepted: str          # the values accepted, for the error
    why: str               # why other values cannot be honoured (or why any value is fine)


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


def _non_negative_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _is_zero(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0


NO_EFFECT_ARGS: dict[str, _Arg] = {
    "tokenizer_mode": _Arg(_is("auto", "hf"), "'auto' or 'hf'",
                           "polyrunner always uses the fast tokenizer (tokenizer.json), as vLLM's 'auto' does; "
                           "slow and mistral tokenizers are not available"),
    "skip_tokenizer_init": _Arg(_is(False), "False",
                                "polyrunner loads the folder's tokenizer when it has one (a folder without "
                                "tokenizer.json already runs token-id prompts only)"),
    "revision": _Arg(_is(None), "None",
                     "polyrunner loads the model folder as it is on disk; pass the folder (or snapshot) of that "
                     "revision instead"),
    "tokenizer_revision": _Arg(_is(None), "None",
                               "polyrunner loads the tokenizer folder as it is on disk; pass the folder of that "
                               "revision as tokenizer= instead"),
    "download_dir": _Arg(_is(None), "None",
                         "polyrunner reads models from a local path or the Hugging Face cache; set HF_HUB_CACHE to "
                         "move that cache"),
    "disable_log_stats": _Arg(_is(True), "True (vLLM's default for LLM)",
                              "the offline LLM logs no periodic stats; `polyrunner serve` reports them at /metrics"),
    "swap_space": _Arg(_non_negative_number, "a number of GiB >= 0",
                       "it is unused: a preempted request is recomputed, never swapped to CPU memory (as in vLLM V1)"),
    "cpu_offload_gb": _Arg(_is_zero, "0", "polyrunner does not offload weights to CPU memory"),
    "task": _Arg(_is("auto", "generate"), "'auto' or 'generate'", "polyrunner runs generative models only"),
}


def check_no_effect_args(kwargs: Mapping[str, Any], known: Iterable[str]) -> None:
    """Accept `kwargs` found in NO_EFFECT_ARGS with values they honour; raise otherwise.

    `known`: the other names `LLM` takes, for the "did you mean" hint."""
    for name, value in kwargs.items():
        arg = NO_EFFECT_ARGS.get(name)
        if arg is None:
            close = difflib.get_close_matches(name, [*known, *NO_EFFECT_ARGS], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"LLM.__init__() got an unexpected keyword argument {name!r}{hint}")
        if not arg.ok(value):
            raise ValueError(f"{name}={value!r} is not supported: {arg.why} (accepted: {arg.accepted})")
        logger.debug("%s=%r accepted: %s", name, value, arg.why)


def note_trust_remote_code(value: Any) -> None:
    """vLLM's trust_remote_code: a bool; True is accepted and logged as not needed."""
    if not isinstance(value, bool):
        raise ValueError(f"trust_remote_code must be a bool, got {value!r}")
    if value:
        logger.info("trust_remote_code=True is not needed: polyrunner implements each architecture itself "
                    "and runs no code from the model's folder")
