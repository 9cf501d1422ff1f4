"""Launch parameters of the Triton paged-attention kernel (`triton_attention`), per shape.

`TABLE` maps (padded head size, dtype class, step kind) to the keys a program walks per
inner step (TILE), the rows it targets (BLOCK_M), `num_warps` and `num_stages`:

- dtype class "half" (float16/bfloat16: tensor-core dots, float32 accumulation) or
  "float32" (IEEE float32 dots on the FMA units, which hold more operands in registers);
- step kind "decode" (every request has one query token; split decode may apply) or
  "prefill" (prefills, chunked prefills and mixed batches).

Principles, checked by tests/test_triton_compile.py with ptxas for sm_90 at head sizes 64,
128 and 256: no entry spills registers, and every entry's shared memory fits one SM. Decode
programs take BLOCK_M = the GQA group G rounded up to >= 16 rows (one query token per
request, so more rows would be idle); prefill programs take 64 or 128 rows in 16-bit dtypes
(32 or 64 in float32), BLOCK_Q = BLOCK_M // G query tokens, so K/V are read once per
BLOCK_Q query tokens rather than per 16 rows. Larger heads take smaller tiles, fewer rows
and/or more warps; float32 takes fewer rows and more warps. Heads padded past 256 take the
256 row, and groups wider than an entry's rows take BLOCK_M = next_power_of_2(G): both
outside the spill-checked range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

StepKind = Literal["decode", "prefill"]
DtypeClass = Literal["half", "float32"]


@dataclass(frozen=True)
class TableEntry:
    """One row of TABLE: keys per inner step, target rows per program, warps, pipeline stages."""
    tile: int
    rows: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class LaunchParams:
    """A launch of the attention kernel: TILE keys per step; BLOCK_M rows = BLOCK_Q query
    tokens x G heads (BLOCK_Q * G <= BLOCK_M, BLOCK_M a power of two >= 16)."""
    tile: int
    block_m: int
    block_q: int
    num_warps: int
    num_stages: int

    def fits(self, group: int) -> bool:
        """Whether the kernel can run with these for GQA group `group` (tl.dot and tl.arange
        need power-of-two sizes >= 16; a program's rows must hold BLOCK_Q whole groups)."""
        pow2 = all(n >= 16 and n & (n - 1) == 0 for n in (self.tile, self.block_m))
        return pow2 and self.block_q >= 1 and self.block_q * group <= self.block_m


HEAD_BUCKETS = (64, 128, 256)
TABLE: dict[tuple[int, DtypeClass, StepKind], TableEntry] = {
    (64, "half", "decode"): TableEntry(tile=32, rows=16, num_warps=4, num_stages=3),
    (128, "half", "decode"): TableEntry(tile=32, rows=16, num_warps=4, num_stages=3),
    (256, "half", "decode"): TableEntry(tile=32, rows=16, num_warps=8, num_stages=3),
    (64, "half", "prefill"): TableEntry(tile=64, rows=128, num_warps=8, num_stages=3),
    (128, "half", "prefill"): TableEntry(tile=64, rows=128, num_warps=8, num_stages=2),
    (256, "half", "prefill"): TableEntry(tile=32, rows=64, num_warps=8, num_stages=2),
    (64, "float32", "decode"): TableEntry(tile=32, rows=16, num_warps=8, num_stages=3),
    (128, "float32", "decode"): TableEntry(tile=16, rows=16, num_warps=4, num_stages=3),
    (256, "float32", "decode"): TableEntry(tile=32, rows=16, num_warps=8, num_stages=2),
    (64, "float32", "prefill"): TableEntry(tile=32, rows=64, num_warps=16, num_stages=3),
    (128, "float32", "prefill"): TableEntry(tile=32, rows=64, num_warps=16, num_stages=3),
    (256, "float32", "prefill"): TableEntry(tile=32, rows=32, num_warps=16, num_stages=3),
}


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def table_key(head_size: int, dtype: torch.dtype, decode_only: bool) -> tuple[int, DtypeClass, StepKind]:
    """The TABLE row for a launch: the smallest head bucket >= the padded head size (else 256)."""
    head_pad = max(16, _next_pow2(head_size))
    bucket = next((b for b in HEAD_BUCKETS if b >= head_pad), HEAD_BUCKETS[-1])
    return bucket, "float32" if dtype == torch.float32 else "half", "decode" if decode_only else "prefill"


def params_for(entry: TableEntry, group: int) -> LaunchParams:
    """`entry` for GQA group `group`: BLOCK_M = max(rows, next_power_of_2(group)), BLOCK_Q = BLOCK_M // group."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    block_m = max(entry.rows, _next_pow2(group))
    return LaunchParams(entry.tile, block_m, block_m // group, entry.num_warps, entry.num_stages)


def launch_params(head_size: int, dtype: torch.dtype, group: int, decode_only: bool) -> LaunchParams:
    """The launch for queries of `dtype` with `head_size` and `group` query heads per KV head;
    `decode_only`: every request of the step has one query token. Depends only on these
    (never on the batch's contents), so a launch is the same at capture and replay."""
    return params_for(TABLE[table_key(head_size, dtype, decode_only)], group)
