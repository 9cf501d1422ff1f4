"""Vectorised per-step input preparation (numpy), padded to a bucket.

Given the slot-indexed request states and the scheduler output (slots, tokens
scheduled and computed per row), build token ids,
positions, slot mapping, query_start_loc, seq_lens and logits indices for
`T` real tokens of `R` requests, padded to `(T_pad, R_pad)` with the tail
invariants of `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from polyrunner.attention.metadata import NULL_BLOCK, NULL_SLOT
from polyrunner.numeric import cumsum_and_arange
from polyrunner.runner.states import RequestStates
from polyrunner.step_channel import SchedulerOutput


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


def _padded(a: np.ndarray, n: int, fill: int, dtype: npt.DTypeLike) -> np.ndarray:
    """`a` (a fresh array, not a view of persistent state) as `dtype`, padded to `n` rows with `fill`."""
    if len(a) == n:
        return a.astype(dtype, copy=False)
    out = np.empty((n,) + a.shape[1:], dtype)
    out[:len(a)] = a
    out[len(a):] = fill
    return out


def prepare_inputs(states: RequestStates, so: SchedulerOutput,
                   padded_tokens: int, padded_reqs: int) -> StepInputs:
    """The step's inputs, gathered by slot (`so.slots`, decodes first), padded to
    `(padded_tokens, padded_reqs)`."""
    slots = so.slots
    R = len(slots)
    nst = so.num_scheduled
    computed = so.num_computed.astype(np.int64)
    T = int(nst.sum())
    max_query_len = int(nst.max()) if R else 0
    decode_only = T == R   # one token per row
    if decode_only:
        cu = np.arange(1, R + 1)
        req_indices = np.arange(R)
        positions = computed
        seq_lens = computed + 1
        token_slots = slots
    else:
        cu, arange = cumsum_and_arange(nst.astype(np.int64))
        req_indices = np.repeat(np.arange(R), nst)
        positions = computed[req_indices] + arange
        seq_lens = computed + nst
        token_slots = slots[req_indices]
    token_ids = states.token_ids[token_slots, positions]
    slot_mapping = states.block_table.slot_mapping(token_slots, positions)

    T_pad, R_pad = max(padded_tokens, T), max(padded_reqs, R)
    qsl = np.empty(R_pad + 1, np.int32)
    qsl[0] = 0
    qsl[1:R + 1] = cu
    qsl[R + 1:] = T
    table = states.block_table.table
    tables = np.empty((R_pad, table.shape[1]), np.int32)
    tables[:R] = table[slots]
    tables[R:] = NULL_BLOCK
    return StepInputs(
        num_tokens=T, num_reqs=R, num_decodes=R if decode_only else int(np.count_nonzero(nst == 1)),
        max_query_len=max_query_len, max_seq_len=int(seq_lens.max()) if R else 0,
        input_ids=_padded(token_ids, T_pad, 0, np.int64),
        positions=_padded(positions, T_pad, 0, np.int64),
        slot_mapping=_padded(slot_mapping, T_pad, NULL_SLOT, np.int64),
        token_to_req=_padded(req_indices, T_pad, 0, np.int32),
        query_start_loc=qsl,
        seq_lens=_padded(seq_lens, R_pad, 0, np.int32),
        block_tables=tables,
        logits_indices=_padded(cu - 1, R_pad, 0, np.int64),
        discard=seq_lens < states.num_tokens[slots],
    )


def next_decode_inputs(prev: StepInputs, sampled: np.ndarray, block_size: int) -> StepInputs | None:
    """The inputs of an all-decode step that follows `prev`, an unpadded all-decode
    step, on the same rows with the same block tables: every position one further,
    each row's input the token `sampled` for it in `prev`. None when some row's new
    position starts a block (its slot must be looked up in the block table).
    Shares `prev`'s token_to_req, query_start_loc, block_tables, logits_indices
    and discard arrays (none of them changes)."""
    positions = prev.positions + 1
    if not (positions % block_size).all():
        return None
    return StepInputs(
        num_tokens=prev.num_tokens, num_reqs=prev.num_reqs, num_decodes=prev.num_decodes,
        max_query_len=prev.max_query_len, max_seq_len=prev.max_seq_len + 1,
        input_ids=sampled.astype(np.int64), positions=positions, slot_mapping=prev.slot_mapping + 1,
        token_to_req=prev.token_to_req, query_start_loc=prev.query_start_loc, seq_lens=prev.seq_lens + 1,
        block_tables=prev.block_tables, logits_indices=prev.logits_indices, discard=prev.discard,
    )


def dummy_step(num_tokens: int, num_reqs: int, max_blocks: int) -> StepInputs:
    """A batch of `num_reqs` requests sharing `num_tokens`, writing only the null block."""
    num_reqs = max(1, min(num_reqs, num_tokens))
    counts = np.full(num_reqs, num_tokens // num_reqs, np.int64)
    counts[num_reqs - num_tokens % num_reqs:] += num_tokens % num_reqs > 0  # longer rows last (decode-first)
    cu, arange = cumsum_and_arange(counts)
    qsl = np.zeros(num_reqs + 1, np.int32)
    qsl[1:] = cu
    return StepInputs(
        num_tokens=num_tokens, num_reqs=num_reqs, num_decodes=int((counts == 1).sum()),
        max_query_len=int(counts.max()), max_seq_len=int(counts.max()),
        input_ids=np.zeros(num_tokens, np.int64), positions=arange.astype(np.int64),
        slot_mapping=np.zeros(num_tokens, np.int64),
        token_to_req=np.repeat(np.arange(num_reqs), counts).astype(np.int32),
        query_start_loc=qsl, seq_lens=counts.astype(np.int32),
        block_tables=np.zeros((num_reqs, max_blocks), np.int32),
        logits_indices=(cu - 1).astype(np.int64), discard=np.zeros(num_reqs, bool))


def pad_dummy(step: StepInputs, T_pad: int, R_pad: int) -> StepInputs:
    """Pad a dummy step to a bucket with the same tail invariants as real steps."""
    T = step.num_tokens

    def pad(a: np.ndarray, n: int, fill: int) -> np.ndarray:
        out = np.full((n,) + a.shape[1:], fill, a.dtype)
        out[: len(a)] = a
        return out

    step.input_ids = pad(step.input_ids, T_pad, 0)
    step.positions = pad(step.positions, T_pad, 0)
    step.slot_mapping = pad(step.slot_mapping, T_pad, 0)
    step.token_to_req = pad(step.token_to_req, T_pad, 0)
    step.query_start_loc = pad(step.query_start_loc, R_pad + 1, T)
    step.seq_lens = pad(step.seq_lens, R_pad, 0)
    step.block_tables = pad(step.block_tables, R_pad, 0)
    step.logits_indices = pad(step.logits_indices, R_pad, 0)
    return step
