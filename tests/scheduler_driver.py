"""Drive a scheduler through a request trace without a model (for scheduler tests)."""

from __future__ import annotations

from collections.abc import Iterator

from polyrunner.engine.request import Request
from polyrunner.engine.scheduler import Scheduler

# (arrival step, abort step or None, request)
TraceEntry = tuple[int, "int | None", Request]


def drive(sched: Scheduler, trace: list[TraceEntry], max_steps: int = 5000) -> Iterator[int]:
    """Yield each step number after adding the requests that arrive by then and
    aborting those due; the caller schedules and updates. Ends when nothing is
    pending or unfinished; fails after `max_steps` (no progress)."""
    pending = sorted(trace, key=lambda x: x[0])
    step = 0
    while pending or sched.num_unfinished:
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[2])
        for _, abort_at, req in trace:
            if abort_at == step:
                sched.abort(req.request_id)
        yield step
        step += 1
        assert step < max_steps, "scheduler made no progress"
