"""Vectorised per-step input preparation (numpy), padded to a bucket.

Given the persistent batch and the tokens scheduled per row, build token ids,
positions, slot mapping, query_start_loc, seq_lens and logits indices for
`T` real tokens of `R` requests, padded to `(T_pad, R_pad)` with the tail
invariants of `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from polyrunner.attention.metadata import NULL_BLOCK, NULL_SLOT
from polyrunner.input_batch import InputBatch


@dataclass
class StepInputs:
    num_tokens: int               # T
    num_reqs: int                 # R
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    input_ids: np.ndarray         # [T_pad] int64
    positions: np.ndarray         # [T_pad] int64
    slot_mapping: np.ndarray      # [T_pad] int64
    token_to_req: np.ndarray      # [T_pad] int32
    query_start_loc: np.ndarray   # [R_pad + 1] int32
    seq_lens: np.ndarray          # [R_pad] int32
    block_tables: np.ndarray      # [R_pad, max_blocks] int32
    logits_indices: np.ndarray    # [R_pad] int64
    discard: np.ndarray           # [R] bool: partial prefill, sample thrown away


def cumsum_and_arange(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[2,5,3] -> cumsum [2,7,10], arange within each count [0,1,0,1,2,3,4,0,1,2]."""
    cu = np.cumsum(counts)
    total = int(cu[-1]) if len(cu) else 0
    arange = np.arange(total) - np.repeat(cu - counts, counts)
    return cu, arange


def prepare_inputs(batch: InputBatch, num_scheduled: np.ndarray,
                   padded_tokens: int, padded_reqs: int) -> StepInputs:
    """`num_scheduled[r]` tokens for each of the batch's first R rows (decode-first order)."""
    R = batch.num_reqs
    nst = num_scheduled[:R].astype(np.int64)
    cu, arange = cumsum_and_arange(nst)
    T = int(cu[-1]) if R else 0
    req_indices = np.repeat(np.arange(R), nst)
    computed = batch.num_computed_tokens[:R].astype(np.int64)
    positions = computed[req_indices] + arange
    token_ids = batch.token_ids.ravel()[req_indices * batch.token_ids.shape[1] + positions]
    seq_lens = (computed + nst).astype(np.int32)

    T_pad, R_pad = max(padded_tokens, T), max(padded_reqs, R)
    ids = np.zeros(T_pad, np.int64)
    ids[:T] = token_ids
    pos = np.zeros(T_pad, np.int64)
    pos[:T] = positions
    slots = np.full(T_pad, NULL_SLOT, np.int64)
    slots[:T] = batch.block_table.slot_mapping(req_indices, positions)
    tok_req = np.zeros(T_pad, np.int32)
    tok_req[:T] = req_indices
    qsl = np.full(R_pad + 1, T, np.int32)
    qsl[0] = 0
    qsl[1:R + 1] = cu
    sl = np.zeros(R_pad, np.int32)
    sl[:R] = seq_lens
    tables = np.full((R_pad, batch.block_table.table.shape[1]), NULL_BLOCK, np.int32)
    tables[:R] = batch.block_table.table[:R]
    logits_idx = np.zeros(R_pad, np.int64)
    logits_idx[:R] = cu - 1
    return StepInputs(
        num_tokens=T, num_reqs=R, num_decodes=int(np.count_nonzero(nst == 1)),
        max_query_len=int(nst.max()) if R else 0, max_seq_len=int(seq_lens.max()) if R else 0,
        input_ids=ids, positions=pos, slot_mapping=slots, token_to_req=tok_req,
        query_start_loc=qsl, seq_lens=sl, block_tables=tables, logits_indices=logits_idx,
        discard=seq_lens < batch.num_tokens[:R],
    )
