"""What a tensor-parallel driver tells its workers each step, compactly.

A worker's runner needs what the driver's runner reads from a
`SchedulerOutput` (slots, token counts, block-id deltas, new requests, draft
tokens) and the slots whose requests left since the last step. The message is
one pickle of the step's fields — numpy arrays and plain values — without the
scheduler's `Request` objects (a worker gets only their count); a request's
prompt and sampling parameters travel once, when it enters its slot. `None`
means "stop".
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from polyrunner.engine.scheduler import NewRequest, SchedulerOutput

# sent another way (`requests`: only their count) or not read by a runner
_NOT_SENT = {"requests", "new_requests", "preempted_req_ids"}
_FIELDS = [f.name for f in dataclasses.fields(SchedulerOutput) if f.name not in _NOT_SENT]


def encode_step(so: SchedulerOutput | None, removed_slots: list[int]) -> bytes:
    """The message for one step (`so` None: only removals)."""
    body = None
    if so is not None:
        news = [(n.request_id, n.slot, np.asarray(n.prompt_token_ids, np.int32), n.params,
                 tuple(n.eos_token_ids), n.bad_words_token_ids) for n in so.new_requests]
        body = (so.num_reqs, news, {name: getattr(so, name) for name in _FIELDS})
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
    num_reqs, news, fields = body
    so = SchedulerOutput(requests=[None] * num_reqs, **fields,
                         new_requests=[NewRequest(rid, slot, ids.tolist(), params, frozenset(eos), bad)
                                       for rid, slot, ids, params, eos, bad in news])
    return removed, so
