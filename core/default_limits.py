"""Scheduler limits the user left unset take the backend's defaults (vLLM's
`EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`).

A limit counts as set when it was passed to `SchedulerConfig` (pydantic's
`model_fields_set`); `LLM(...)` and the command line pass only what the user gave.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from polyrunner.config import EngineConfig

logger = logging.getLogger(__name__)

LIMITS = ("max_num_seqs", "max_num_batched_tokens")


def apply_default_limits(config: EngineConfig, limits: Mapping[str, int], max_model_len: Callable[[], int]) -> None:
    """Set each limit of `limits` (keys from LIMITS) that `config.scheduler` leaves unset, then
    clamp the defaulted ones as vLLM does: the token budget is at least max_model_len without
    chunked prefill and at most max_num_seqs * max_model_len; max_num_seqs at most the
    budget. `max_model_len()` is called only for a defaulted budget."""
    unknown = set(limits) - set(LIMITS)
    if unknown:
        raise ValueError(f"default_limits gave {sorted(unknown)}; allowed keys: {', '.join(LIMITS)}")
    sched = config.scheduler
    defaulted = [name for name in LIMITS if name in limits and name not in sched.model_fields_set]
    if not defaulted:
        return
    seqs = limits["max_num_seqs"] if "max_num_seqs" in defaulted else sched.max_num_seqs
    tokens = limits["max_num_batched_tokens"] if "max_num_batched_tokens" in defaulted else sched.max_num_batched_tokens
    if "max_num_batched_tokens" in defaulted:
        model_len = max_model_len()
        if not sched.enable_chunked_prefill:
            tokens = max(tokens, model_len)
        tokens = min(tokens, seqs * model_len)
        sched.max_num_batched_tokens = tokens
    if "max_num_seqs" in defaulted:
        sched.max_num_seqs = min(seqs, tokens)
    logger.info("scheduler limits from the backend's defaults for %s: %s", config.runner.usage_context,
                ", ".join(f"{name}={getattr(sched, name)}" for name in defaulted))
