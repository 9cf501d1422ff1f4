"""Continuous batching: who runs this step, with how many tokens.

One token budget covers prefills and decodes alike (chunked prefill splits a
long prompt over steps). Running requests go first, in arrival order; when the
block pool runs dry the newest running request is preempted (its blocks freed,
recomputed later). Waiting requests are admitted while budget, `max_num_seqs`
and blocks allow. With prefix caching, a waiting request whose prefix
continues into blocks another request computes this step waits one step and
then takes them from the cache, so a shared prefix is computed once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from polyrunner.config import SchedulerConfig
from polyrunner.kv_manager import KVCacheManager
from polyrunner.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """A request in this step: the runner caches its state across steps."""

    request: Request
    num_tokens: int            # tokens to compute this step
    new_block_ids: list[int]   # blocks added this step (all blocks when `is_new`)
    is_new: bool               # first step, or resumed after preemption (runner replaces its state)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)   # since the last step
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished: set[str] = set()
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step --------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished)
        self._finished = set()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill

        kept: list[Request] = []
        threshold = self.config.long_prefill_token_threshold
        block_size = self.kv.block_size
        held_blocks = self.kv.blocks
        caching = self.kv.enable_prefix_caching
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = len(req.prompt_token_ids) + len(req.output_token_ids) - req.num_computed_tokens
            n = min(remaining, budget, threshold) if threshold > 0 else min(remaining, budget)
            if not chunked and n < remaining:
                i += 1
                kept.append(req)
                continue
            if req.num_computed_tokens + n <= len(held_blocks[req.request_id]) * block_size:
                new_blocks = []  # fast path: the step fits the blocks already held
            else:
                new_blocks = self.kv.allocate(req, n)
                while new_blocks is None and self.running[-1] is not req:
                    self._preempt(self.running.pop(), out)
                    new_blocks = self.kv.allocate(req, n)
                if new_blocks is None:  # nothing left to preempt but itself
                    self._preempt(self.running.pop(), out)
                    break
            out.scheduled.append(ScheduledRequest(req, n, new_blocks, False))
            if caching:
                self.kv.mark_computing(req, n)
            budget -= n
            kept.append(req)
            i += 1
        kept.extend(self.running[i:])
        self.running = kept

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.preempted_req_ids:
                break  # memory is short this step; admit nobody new
            req = self.waiting[0]
            if req.num_computed_tokens == 0:
                hit = self.kv.take_cached_prefix(req)
                if hit is None:
                    break  # its prefix is being computed this step: hit it next step
                req.num_computed_tokens = req.num_cached_tokens = hit
            n = min(self._num_new_tokens(req), budget)
            if not chunked and n < req.num_tokens - req.num_computed_tokens:
                self._release_prefix(req)
                break
            new_blocks = self.kv.allocate(req, n)
            if new_blocks is None:
                self._release_prefix(req)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, list(self.kv.blocks[req.request_id]), is_new=True))
            if caching:
                self.kv.mark_computing(req, n)
            budget -= n
        return out

    def _num_new_tokens(self, req: Request) -> int:
        n = req.num_tokens - req.num_computed_tokens
        threshold = self.config.long_prefill_token_threshold
        return min(n, threshold) if threshold > 0 else n

    def _release_prefix(self, req: Request) -> None:
        """Undo a prefix-cache claim for a request that could not be admitted."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.add(req.request_id)

    # ---- after the step ----------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance progress, append sampled tokens, apply stop rules.
        Returns the scheduled requests that produced tokens (finished ones included)."""
        updated = []
        cache = self.kv.cache_computed if self.kv.enable_prefix_caching else None
        for s in out.scheduled:
            req = s.request
            if req.finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_tokens
            if cache is not None:
                cache(req)
            tokens = sampled.get(req.request_id)
            if not tokens:
                continue  # partial prefill: nothing sampled yet
            req.output_token_ids.extend(tokens)
            self.check_stop(req)
            updated.append(req)
        return updated

    def check_stop(self, req: Request) -> None:
        """max_tokens / max_model_len -> length; EOS / stop_token_ids -> stop."""
        outputs = req.output_token_ids
        last = outputs[-1]
        params = req.params
        n_out = len(outputs)
        if n_out >= params.min_tokens:
            if last in req.eos_token_ids and not params.ignore_eos:
                self._finish(req, RequestStatus.FINISHED_STOPPED, None)
                return
            if params.stop_token_ids and last in params.stop_token_ids:
                self._finish(req, RequestStatus.FINISHED_STOPPED, last)
                return
        if n_out >= req.max_tokens or len(req.prompt_token_ids) + n_out >= self.max_model_len:
            self._finish(req, RequestStatus.FINISHED_LENGTH)

    def finish_with_stop_string(self, req: Request, stop: str) -> None:
        """A stop string matched (detected after the step); wins over length/EOS."""
        if req.status.finished:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        else:
            self._finish(req, RequestStatus.FINISHED_STOPPED, stop)

    def _finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        req.finished = True
        req.stop_reason = stop_reason
        self.kv.free(req)
        self._finished.add(req.request_id)
        del self.requests[req.request_id]
