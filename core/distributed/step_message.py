"""What a tensor-parallel driver tells its workers each step, compactly.

A worker's runner needs what the driver's runner reads from a
`SchedulerOutput` (slots, token counts, block-id deltas, new requests, draft
tokens, the slots whose requests finished since the last step). The message is
one pickle of the step's fields — numpy arrays and plain values — without the
scheduler's `Request` objects (a worker gets only their count); a request's
prompt and sampling parameters travel once, when it enters its slot. `None`
means "stop".
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from polyrunner.step_channel import NewRequest, SchedulerOutput

# sent another way (`requests`: only their count) or not read by a runner
_NOT_SENT = {"requests", "new_requests", "preempted_req_ids"}
_FIELDS = [f.name for f in dataclasses.fields(SchedulerOutput) if f.name not in _NOT_SENT]


def encode_step(so: SchedulerOutput) -> bytes:
    """The message for one step."""
    news = [(n.request_id, n.slot, np.asarray(n.prompt_token_ids, np.int32), n.params,
             tuple(n.eos_token_ids), n.bad_words_token_ids, n.lora_request) for n in so.new_requests]
    body = (so.num_reqs, news, {name: getattr(so, name) for name in _FIELDS})
    return pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)


def encode_stop() -> bytes:
    return pickle.dumps(None)


def decode_step(payload: bytes) -> SchedulerOutput | None:
    """The step, or None for "stop"."""
    msg = pickle.loads(payload)
    if msg is None:
        return None
    num_reqs, news, fields = msg
    return SchedulerOutput(requests=[None] * num_reqs, **fields,
                           new_requests=[NewRequest(rid, slot, ids.tolist(), params, frozenset(eos), bad, lora)
                                         for rid, slot, ids, params, eos, bad, lora in news])
