"""The static-shape torch attention on XLA, bounded by the step's context.

`polyrunner.attention.static_shape` gathers, per layer, `T_pad x table width x block_size`
keys and values (float32 scores). With the full `max_model_len`-wide block table that is
`T_pad x max_model_len` whatever the real context. Here the per-token block table is cut to
a *context bucket*: the smallest of `context_buckets` (doubling from
`POLYRUNNER_XLA_MIN_CONTEXT` tokens up to max_model_len) that holds the step's longest
sequence, so a 64-token context gathers 64 keys, not max_model_len. Each (token bucket,
context bucket) pair is one backbone graph, all precompiled.

The path is meant for the CPU PJRT device (CI). On a real device it is chosen only when its
gather at the largest buckets fits `POLYRUNNER_XLA_STATIC_GATHER_BYTES`; otherwise
`check_gather_fits` refuses with the sizes (use Pallas).
"""

from __future__ import annotations

import numpy as np

from polyrunner.plugin_api import NULL_BLOCK, TOKEN_BLOCK_TABLES, StepInputs, cdiv

FP32 = 4


def context_buckets(max_model_len: int, block_size: int, min_context: int) -> list[int]:
    """Block-table widths (in blocks): doubling from `min_context` tokens, the last max_model_len's."""
    if min_context < 1:
        raise ValueError(f"POLYRUNNER_XLA_MIN_CONTEXT={min_context}: must be >= 1")
    full = cdiv(max_model_len, block_size)
    out, width = [], cdiv(min_context, block_size)
    while width < full:
        out.append(width)
        width *= 2
    return out + [full]


def token_tables(step: StepInputs, block_size: int, buckets: list[int],
                 width: int | None = None) -> dict[str, np.ndarray]:
    """The per-token block table cut to the context bucket of `step` (or to `width` blocks)."""
    full = step.block_tables.shape[1]
    if width is None:
        need = cdiv(int(step.seq_lens[:step.num_reqs].max(initial=1)), block_size)
        width = next((b for b in buckets if b >= need), full)
    tables = step.block_tables[step.token_to_req, :min(width, full)]
    tables[step.num_tokens:] = NULL_BLOCK
    return {TOKEN_BLOCK_TABLES: tables}


def gather_bytes(tokens: int, context: int, num_kv_heads: int, head_size: int) -> int:
    """Bytes one layer's gather holds: keys and values, `tokens x context` of them, in float32."""
    return 2 * tokens * context * num_kv_heads * head_size * FP32


def check_gather_fits(tokens: int, context: int, num_kv_heads: int, head_size: int, limit: int) -> None:
    """Refuse the static path when its gather at the largest buckets exceeds `limit` bytes."""
    need = gather_bytes(tokens, context, num_kv_heads, head_size)
    if need > limit:
        raise ValueError(
            f"xla: the static-shape torch attention would gather {need / 2**30:.2f} GiB per layer "
            f"(token bucket {tokens} x context {context} x {num_kv_heads} KV heads x head size {head_size} "
            f"x K and V in float32), over POLYRUNNER_XLA_STATIC_GATHER_BYTES={limit}; use Pallas "
            "(POLYRUNNER_XLA_PALLAS=1) or lower max_num_batched_tokens / max_model_len")
