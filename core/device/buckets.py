"""Padding buckets: which padded batch shapes exist, and how a batch is padded.

A backend that replays captured or compiled graphs can only run the shapes it
prepared. `BucketPolicy` holds the sorted token and request bucket lists and
pads a (tokens, requests) pair to the smallest bucket that covers it. An empty
list means "no padding" on that axis (eager execution).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


def capture_sizes(max_size: int) -> list[int]:
    """CUDA-graph style sizes: 1, 2, 4, then every multiple of 8 up to max_size."""
    sizes = [s for s in (1, 2, 4) if s < max_size] + list(range(8, max_size + 1, 8))
    if not sizes or sizes[-1] != max_size:
        sizes.append(max_size)
    return sorted(set(sizes))


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, limit: int = 512) -> list[int]:
    """vLLM's default CUDA-graph capture sizes: up to min(2 * max_num_seqs, limit),
    1, 2, 4, then multiples of 8 below 256 and multiples of 16 from 256 on;
    sizes above max_num_batched_tokens are dropped (never below [1])."""
    top = min(2 * max_num_seqs, limit)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, top + 1, 16))
    return [s for s in sizes if s <= top and s <= max_num_batched_tokens] or [1]


def decode_capture_sizes(sizes: list[int], max_num_seqs: int) -> list[int]:
    """The sizes a decode-only (one token per request) graph can use: those up
    to max_num_seqs (vLLM's FULL_DECODE_ONLY filter), plus the smallest size
    above it when max_num_seqs is not one, so that every decode batch has a graph."""
    below = [s for s in sorted(sizes) if s <= max_num_seqs]
    above = [s for s in sorted(sizes) if s > max_num_seqs]
    return below + above[:1] if (not below or below[-1] != max_num_seqs) else below


def exponential_sizes(min_size: int, max_size: int) -> list[int]:
    """Powers of two from min_size (rounded up to a power of two) up to max_size (inclusive)."""
    size = 1 << max(0, (min_size - 1).bit_length())
    sizes = []
    while size < max_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_size)
    return sorted(set(sizes))


def gap_incremental_sizes(min_size: int, gap: int, max_size: int) -> list[int]:
    """Double from min_size until `gap`, then grow by `gap`, ending at max_size."""
    size = 1 << max(0, (min_size - 1).bit_length())
    sizes = []
    while size < max_size:
        sizes.append(size)
        size = size * 2 if size < gap else size + gap
    sizes.append(max_size)
    return sorted(set(sizes))


def _lookup(buckets: list[int], n: int, axis: str) -> int:
    if not buckets:
        return n
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{axis}={n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class BucketPolicy:
    """Sorted, unique token and request buckets; empty = no padding on that axis.

    `max_padding(n, axis)` is the policy's own waste bound: padding n to its
    bucket never adds more than this many rows (checked by the conformance suite).
    """

    token_buckets: list[int] = field(default_factory=list)
    request_buckets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("token_buckets", "request_buckets"):
            b = getattr(self, name)
            if any(x < 1 for x in b) or b != sorted(set(b)):
                raise ValueError(f"{name} must be sorted, unique and >= 1, got {b}")

    def pad(self, num_tokens: int, num_reqs: int) -> tuple[int, int]:
        """Smallest (token_bucket, request_bucket) covering the batch; ValueError above the largest."""
        return (_lookup(self.token_buckets, num_tokens, "num_tokens"),
                _lookup(self.request_buckets, num_reqs, "num_reqs"))

    def max_padding(self, n: int, axis: str = "tokens") -> int:
        """Waste bound: the largest gap between consecutive buckets at or below n's bucket."""
        buckets = self.token_buckets if axis == "tokens" else self.request_buckets
        if not buckets:
            return 0
        padded = _lookup(buckets, n, axis)
        i = buckets.index(padded)
        prev = buckets[i - 1] if i > 0 else 0
        return padded - prev - 1
