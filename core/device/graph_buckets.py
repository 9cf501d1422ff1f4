"""Graph modes and the padding that matches them (vLLM's `CUDAGraphMode` names).

- FULL_DECODE_ONLY: full-model graphs of uniform-decode steps (one token per
  request), keyed by the padded batch size B (B tokens, B requests); any other
  step runs eagerly.
- FULL: also full graphs of mixed steps (prefills, chunked prefills with
  context, decodes, speculative verification), keyed by the padded token count
  T, each with R(T) = min(T, R_cap) padded requests (R_cap: max_num_seqs rounded
  up to a decode size). Needs a length-adaptive attention (one that reads every
  length on the device); otherwise it falls back to FULL_DECODE_ONLY.
- NONE: no graphs and no padding (what enforce_eager=True means).

Fallback order: FULL -> FULL_DECODE_ONLY (attention not length-adaptive; logged
once, `StaticGraphExecutor.fallback_reason`) -> eager, per step (a step no
graph covers; counted by reason). PIECEWISE modes need torch.compile's graph
split and are refused by the config.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from polyrunner.config import GRAPH_MODES
from polyrunner.device.buckets import BucketPolicy, cudagraph_capture_sizes, decode_capture_sizes

if TYPE_CHECKING:
    from polyrunner.config import EngineConfig

MAX_CAPTURE_SIZE = 512
NONE, FULL_DECODE_ONLY, FULL = GRAPH_MODES   # vLLM's names (`runner.cudagraph_mode`)
__all__ = ["FULL", "FULL_DECODE_ONLY", "GRAPH_MODES", "MAX_CAPTURE_SIZE", "NONE", "FullGraphBucketPolicy",
           "GraphBucketPolicy", "graph_bucket_policy", "graph_token_sizes", "mixed_token_sizes",
           "requested_graph_mode", "resolve_graph_mode"]


def requested_graph_mode(config: EngineConfig, default: str) -> str:
    """NONE under enforce_eager; else `runner.cudagraph_mode`, or the backend's `default` when unset."""
    if config.runner.enforce_eager:
        return NONE
    return config.runner.cudagraph_mode or default


def resolve_graph_mode(mode: str, length_adaptive: bool) -> tuple[str, str | None]:
    """(the mode that runs, why it differs from `mode` or None): FULL without a
    length-adaptive attention falls back to FULL_DECODE_ONLY."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"cudagraph_mode must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if mode == FULL and not length_adaptive:
        return FULL_DECODE_ONLY, ("cudagraph_mode FULL needs a length-adaptive attention (one that reads "
                                  "query_start_loc, seq_lens and block tables on the device, e.g. the Triton op); "
                                  "falling back to FULL_DECODE_ONLY: mixed and prefill steps run eagerly")
    return mode, None


# ---- buckets ---------------------------------------------------------------
def _up(buckets: list[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def _gap_bound(buckets: list[int], n: int) -> int:
    """The largest gap below n's bucket (0 above the largest bucket: unpadded)."""
    if not buckets or n > buckets[-1]:
        return 0
    i = bisect.bisect_left(buckets, n)
    return buckets[i] - (buckets[i - 1] if i else 0) - 1


@dataclass(frozen=True)
class GraphBucketPolicy(BucketPolicy):
    """Capture-size buckets; a batch above the largest bucket is not padded."""

    def pad(self, num_tokens: int, num_reqs: int) -> tuple[int, int]:
        return _up(self.token_buckets, num_tokens), _up(self.request_buckets, num_reqs)

    def max_padding(self, n: int, axis: str = "tokens") -> int:
        return _gap_bound(self.token_buckets if axis == "tokens" else self.request_buckets, n)


@dataclass(frozen=True)
class FullGraphBucketPolicy(GraphBucketPolicy):
    """FULL mode. A uniform-decode batch (tokens == requests, up to the largest
    decode size) pads as `GraphBucketPolicy` over `decode_sizes`; any other batch
    pads its tokens to the next of `mixed_sizes` (T) and its requests to that
    graph's `mixed_reqs(T)` (padded requests have query length 0); a batch above
    the largest mixed size keeps its tokens (eager) and pads its requests to
    R_cap. `token_buckets`/`request_buckets` are the union of both kinds' sizes."""

    decode_sizes: list[int] = field(default_factory=list)
    mixed_sizes: list[int] = field(default_factory=list)
    request_cap: int = 1   # R_cap: max_num_seqs rounded up to a decode size

    @classmethod
    def make(cls, decode_sizes: list[int], mixed_sizes: list[int], max_num_seqs: int) -> FullGraphBucketPolicy:
        cap = max(max_num_seqs, _up(decode_sizes, max_num_seqs))
        reqs = sorted(set(decode_sizes) | {min(t, cap) for t in mixed_sizes})
        return cls(sorted(set(decode_sizes) | set(mixed_sizes)), reqs, decode_sizes, mixed_sizes, cap)

    def mixed_reqs(self, num_tokens: int) -> int:
        """R of the mixed graph for `num_tokens` (a mixed size)."""
        return min(num_tokens, self.request_cap)

    def is_decode_shape(self, num_tokens: int, num_reqs: int) -> bool:
        return num_tokens == num_reqs and bool(self.decode_sizes) and num_tokens <= self.decode_sizes[-1]

    def pad(self, num_tokens: int, num_reqs: int) -> tuple[int, int]:
        if self.is_decode_shape(num_tokens, num_reqs):
            size = _up(self.decode_sizes, num_tokens)
            return size, size
        if not self.mixed_sizes or num_tokens > self.mixed_sizes[-1]:
            return num_tokens, max(num_reqs, self.request_cap)   # eager; requests padded to stay monotonic
        T = _up(self.mixed_sizes, num_tokens)
        return T, max(num_reqs, self.mixed_reqs(T))

    def max_padding(self, n: int, axis: str = "tokens") -> int:
        """Tokens: the larger gap bound of the two size lists; requests: up to R_cap
        (padded requests of a mixed graph do no work)."""
        if axis == "tokens":
            return max(_gap_bound(self.decode_sizes, n), _gap_bound(self.mixed_sizes, n))
        return max(_gap_bound(self.decode_sizes, n), self.request_cap - n if self.mixed_sizes else 0)


def graph_token_sizes(config: EngineConfig) -> list[int]:
    """The token counts decode graphs are captured for under `config` (`runner.token_buckets`, else
    vLLM's decode capture sizes), whether or not enforce_eager turns graphs off."""
    sched = config.scheduler
    sizes = decode_capture_sizes(
        cudagraph_capture_sizes(sched.max_num_seqs, sched.max_num_batched_tokens, MAX_CAPTURE_SIZE),
        sched.max_num_seqs)
    return sorted(set(config.runner.token_buckets or sizes))


def mixed_token_sizes(config: EngineConfig) -> list[int]:
    """The token counts mixed graphs (FULL mode) are captured for: `runner.token_buckets`,
    else vLLM's capture sizes up to min(max_num_batched_tokens, 512) plus that top itself;
    sizes below 2 (a one-token step is a decode) and above max_num_batched_tokens dropped."""
    mnbt = config.scheduler.max_num_batched_tokens
    top = min(mnbt, MAX_CAPTURE_SIZE)
    sizes = config.runner.token_buckets or [*cudagraph_capture_sizes(MAX_CAPTURE_SIZE, top, MAX_CAPTURE_SIZE), top]
    return sorted({s for s in sizes if 2 <= s <= mnbt})


def graph_bucket_policy(config: EngineConfig, max_size: int | None = None,
                        mode: str = FULL_DECODE_ONLY) -> BucketPolicy:
    """The padding for graphs of `mode` (the executor's): decode capture sizes (or
    `runner.token_buckets`/`request_buckets`), plus under FULL the mixed sizes
    (`FullGraphBucketPolicy`); none under enforce_eager or cudagraph_mode NONE.
    `max_size`: the largest batch the backend's graphs can take (larger ones run unpadded)."""
    if config.runner.enforce_eager or config.runner.cudagraph_mode == NONE or mode == NONE:
        return BucketPolicy()
    tokens = [t for t in graph_token_sizes(config) if max_size is None or t <= max_size]
    if mode == FULL:
        mixed = [t for t in mixed_token_sizes(config) if max_size is None or t <= max_size]
        if mixed:
            return FullGraphBucketPolicy.make(tokens, mixed, config.scheduler.max_num_seqs)
    if not tokens:
        return BucketPolicy()
    reqs = sorted(set(config.runner.request_buckets or tokens))
    return GraphBucketPolicy(tokens, reqs)
