"""Synthetic steps: real `prepare_inputs` output for chosen batch shapes.

`SyntheticBatch` stands in for the runner's slot-indexed request states (the
arrays `prepare_inputs` reads; slot r is row r), so the checks drive the core's own input
preparation and padding, with block ids, contexts and token ids they choose.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from polyrunner.numeric import cdiv
from polyrunner.runner.block_table import BlockTable
from polyrunner.runner.inputs import StepInputs, prepare_inputs
from polyrunner.step_channel import SchedulerOutput


@dataclass
class SyntheticBatch:
    token_ids: np.ndarray            # [R, max_model_len] int64
    num_tokens: np.ndarray           # [R] tokens known (context + scheduled)
    num_prompt_tokens: np.ndarray    # [R]
    num_computed_tokens: np.ndarray  # [R] context already in the KV cache
    block_table: BlockTable
    num_scheduled: np.ndarray        # [R] tokens of this step (decodes first)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled)

    @property
    def num_step_tokens(self) -> int:
        return int(self.num_scheduled.sum())

    def step(self, T_pad: int, R_pad: int) -> StepInputs:
        so = SchedulerOutput(slots=np.arange(self.num_reqs, dtype=np.int32), num_scheduled=self.num_scheduled,
                             num_computed=self.num_computed_tokens)
        return prepare_inputs(self, so, T_pad, R_pad)

    def context_batch(self) -> "SyntheticBatch | None":
        """The step that writes these requests' contexts (rows with context > 0), from position 0."""
        rows = np.flatnonzero(self.num_computed_tokens > 0)
        if not len(rows):
            return None
        table = BlockTable(len(rows), self.block_table.table.shape[1], self.block_table.block_size)
        for i, r in enumerate(rows):
            table.append_row(i, self.block_table.table[r, : self.block_table.num_blocks[r]].tolist())
        ctx = self.num_computed_tokens[rows]
        order = np.concatenate([np.flatnonzero(ctx == 1), np.flatnonzero(ctx != 1)])  # decode-first
        table.table, table.num_blocks = table.table[order], table.num_blocks[order]
        return SyntheticBatch(self.token_ids[rows][order], ctx[order].copy(), ctx[order].copy(),
                              np.zeros(len(rows), np.int32), table, ctx[order].astype(np.int32))


def split_counts(rng: np.random.Generator, T: int, R: int, all_decode: bool) -> np.ndarray:
    """Tokens per request for T tokens over R requests, decodes (1 token) first."""
    if R < 1 or T < R:
        raise ValueError(f"cannot split {T} tokens over {R} requests")
    if all_decode or T == R:
        if T != R:
            raise ValueError(f"a decode-only batch has T == R, got T={T}, R={R}")
        return np.ones(R, np.int32)
    d = int(rng.integers(max(0, 2 * R - T), R))  # prefill rows get >= 2 tokens each
    n_pre = R - d
    extra = T - d - 2 * n_pre
    prefills = 2 + rng.multinomial(extra, np.full(n_pre, 1.0 / n_pre))
    return np.concatenate([np.ones(d, np.int32), prefills.astype(np.int32)])


def make_batch(rng: np.random.Generator, counts: np.ndarray, *, vocab: int, block_size: int,
               max_model_len: int, num_blocks: int, context_budget: int,
               max_context: int = 40, min_decode_context: int = 1) -> SyntheticBatch:
    """Requests scheduling `counts` tokens, each with a random context already cached
    (decodes >= 1 token of context, prefills 0 or more), on distinct random blocks
    in [1, num_blocks). The contexts together stay within `context_budget` tokens."""
    R = len(counts)
    max_blocks = cdiv(max_model_len, block_size)
    ctx = np.zeros(R, np.int64)
    for r in range(R):
        room = min(max_context, max_model_len - int(counts[r]))
        lo = max(1, min_decode_context) if counts[r] == 1 else 0
        ctx[r] = int(rng.integers(lo, max(lo, room) + 1)) if room >= lo else 0
    floor = np.where(counts == 1, max(1, min_decode_context), 0)
    while ctx.sum() > context_budget and (ctx > floor).any():  # shrink contexts to fit the setup step
        r = int(np.argmax(ctx - floor))
        ctx[r] = max(int(floor[r]), int(ctx[r]) // 2)
    total = ctx + counts
    need = cdiv(total, block_size)
    if need.sum() > num_blocks - 1:
        raise ValueError(f"a synthetic batch needs {need.sum()} KV blocks, the cache has {num_blocks - 1}")
    blocks = rng.permutation(np.arange(1, num_blocks))[: need.sum()]
    table = BlockTable(R, max_blocks, block_size)
    start = 0
    for r in range(R):
        table.append_row(r, blocks[start: start + need[r]].tolist())
        start += need[r]
    token_ids = np.zeros((R, max_model_len), np.int64)
    token_ids[:, :] = rng.integers(3, vocab, size=(R, max_model_len))
    return SyntheticBatch(token_ids, total.astype(np.int32), total.astype(np.int32),
                          ctx.astype(np.int32), table, np.asarray(counts, np.int32))


def with_new_tokens(batch: SyntheticBatch, rng: np.random.Generator, vocab: int) -> SyntheticBatch:
    """The same shapes, blocks and contexts with different token ids in the step's positions."""
    ids = batch.token_ids.copy()
    for r in range(batch.num_reqs):
        c, n = int(batch.num_computed_tokens[r]), int(batch.num_scheduled[r])
        ids[r, c:c + n] = (ids[r, c:c + n] + rng.integers(1, vocab - 3, size=n) - 3) % (vocab - 3) + 3
    return SyntheticBatch(ids, batch.num_tokens, batch.num_prompt_tokens, batch.num_computed_tokens,
                          batch.block_table, batch.num_scheduled)


def model_inputs(backend, step: StepInputs, kv_caches):
    """`ModelInputs` on the backend's device, built exactly as the runner builds them."""
    from polyrunner.runner.model_runner import ModelRunner
    return ModelRunner._to_device(SimpleNamespace(backend=backend, kv_caches=kv_caches), step)
