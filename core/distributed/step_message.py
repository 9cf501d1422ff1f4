"""What a tensor-parallel driver tells its workers each step, compactly.

A worker's runner needs exactly what the driver's runner reads from a
`SchedulerOutput` (slots, token counts, block-id deltas, new requests) and the
slots whose requests left since the last step. The message is one pickle of
numpy arrays and plain tuples; a request's prompt and sampling parameters
travel once, when it enters its slot. `None` means "stop".
"""

from __future__ import annotations

import pickle

import numpy as np

from polyrunner.engine.scheduler import NewRequest, SchedulerOutput


def encode_step(so: SchedulerOutput | None, removed_slots: list[int]) -> bytes:
    """The message for one step (`so` None: only removals) ."""
    body = None
    if so is not None:
        news = [(n.request_id, n.slot, np.asarray(n.prompt_token_ids, np.int32), n.params,
                 tuple(n.eos_token_ids), n.bad_words_token_ids) for n in so.new_requests]
        blocks = {int(slot): np.asarray(ids, np.int32) for slot, ids in so.new_block_ids.items()}
        body = (so.num_reqs, so.slots, so.num_scheduled, so.num_computed, so.samples, news, blocks,
                list(so.reset_block_slots))
    return pickle.dumps((removed_slots, body), protocol=pickle.HIGHEST_PROTOCOL)


def encode_stop() -> bytes:
    return pickle.dumps(None)


def decode_step(payload: bytes) -> tuple[list[int], SchedulerOutput | None] | None:
    """(removed slots, the step or None); None for "stop"."""
    msg = pickle.loads(payload)
    if msg is None:
        return None
    removed, body = msg
    if body is None:
        return removed, None
    num_reqs, slots, num_scheduled, num_computed, samples, news, blocks, resets = body
    so = SchedulerOutput(
        requests=[None] * num_reqs, slots=slots, num_scheduled=num_scheduled, num_computed=num_computed,
        new_requests=[NewRequest(rid, slot, ids.tolist(), params, frozenset(eos), bad)
                      for rid, slot, ids, params, eos, bad in news],
        new_block_ids={slot: ids.tolist() for slot, ids in blocks.items()}, reset_block_slots=resets,
        samples=samples)
    return removed, so
