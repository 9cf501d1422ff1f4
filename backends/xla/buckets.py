"""TPU-style padding buckets: exponential or gap-incremental token counts,
powers of two for requests.

Sources, first match wins, per axis:
  1. `RunnerConfig.token_buckets` / `request_buckets` (explicit lists);
  2. `POLYRUNNER_XLA_TOKEN_BUCKETS` / `POLYRUNNER_XLA_REQUEST_BUCKETS`
     (comma-separated lists);
  3. generated: tokens from `POLYRUNNER_XLA_MIN_TOKENS` (default 16, a power
     of two) doubling up to `max_num_batched_tokens`, or, when
     `POLYRUNNER_XLA_BUCKET_GAP` > 0, doubling until the gap and then growing
     by the gap; requests 8, 16, 32, ... capped at `max_num_seqs` and at the
     attention kernel's limit (`max_reqs_limit`).

The largest token bucket must cover `max_num_batched_tokens` (one request can
be scheduled that many tokens). A largest request bucket below `max_num_seqs`
is allowed: the runner then splits such a step into row windows.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from polyrunner.backends.xla import envs
from polyrunner.plugin_api import BucketPolicy, exponential_sizes, gap_incremental_sizes

if TYPE_CHECKING:
    from polyrunner.plugin_api import EngineConfig

logger = logging.getLogger(__name__)

MIN_NUM_SEQS = 8
DEFAULT_MIN_TOKENS = 16


def token_buckets(max_tokens: int, min_tokens: int = DEFAULT_MIN_TOKENS, gap: int = 0) -> list[int]:
    """Exponential (gap == 0) or gap-incremental token buckets ending at max_tokens."""
    if min_tokens < 1 or min_tokens & (min_tokens - 1):
        raise ValueError(f"the minimum token bucket must be a power of two, got {min_tokens}")
    if gap < 0:
        raise ValueError(f"the bucket gap must be >= 0, got {gap}")
    if max_tokens <= min_tokens:
        return [max_tokens] if max_tokens == min_tokens else [min_tokens]
    if gap == 0:
        return exponential_sizes(min_tokens, max_tokens)
    return gap_incremental_sizes(min_tokens, gap, max_tokens)


def request_buckets(max_num_seqs: int, limit: int | None = None) -> list[int]:
    """8, 16, 32, ... then max_num_seqs (capped at `limit`, a kernel's request limit)."""
    top = max_num_seqs if limit is None else max(1, min(max_num_seqs, limit))
    return exponential_sizes(MIN_NUM_SEQS, top) if top > MIN_NUM_SEQS else [top]


def xla_bucket_policy(config: "EngineConfig", max_reqs_limit: int | None = None) -> BucketPolicy:
    sched, runner = config.scheduler, config.runner
    tokens = runner.token_buckets or envs.TOKEN_BUCKETS.get()
    if tokens is None:
        tokens = token_buckets(sched.max_num_batched_tokens, envs.MIN_TOKENS.get(), envs.BUCKET_GAP.get())
    reqs = runner.request_buckets or envs.REQUEST_BUCKETS.get()
    if reqs is None:
        reqs = request_buckets(sched.max_num_seqs, max_reqs_limit)
    tokens, reqs = sorted(set(tokens)), sorted(set(reqs))
    if tokens[-1] < sched.max_num_batched_tokens:
        raise ValueError(
            f"the largest token bucket ({tokens[-1]}) must cover scheduler.max_num_batched_tokens "
            f"({sched.max_num_batched_tokens}): a single request may be scheduled that many tokens")
    policy = BucketPolicy(token_buckets=tokens, request_buckets=reqs)
    logger.info("xla buckets: %d token buckets %s, %d request buckets %s",
                len(tokens), tokens, len(reqs), reqs)
    return policy
