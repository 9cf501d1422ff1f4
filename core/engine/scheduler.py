"""Continuous batching: who runs this step, with how many tokens.

One token budget covers prefills and decodes alike (chunked prefill splits a
long prompt over steps). Running requests go first, in arrival order; when the
block pool runs dry the newest running request is preempted (its blocks freed,
recomputed later). Waiting requests are admitted while budget, `max_num_seqs`
and blocks allow. With prefix caching, a waiting request whose prefix
continues into blocks another request computes this step waits one step and
then takes them from the cache, so a shared prefix is computed once.

The common step, where every running request decodes one token, takes a
vectorised fast path (`_schedule_decodes`, `_update_decodes`) over a numpy
mirror of the running requests (`RunningArrays`); it makes exactly the
decisions of the general loop, which handles everything else.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from polyrunner.config import SchedulerConfig
from polyrunner.engine.kv_manager import KVCacheManager
from polyrunner.engine.request import Request, RequestStatus
from polyrunner.engine.running_arrays import RunningArrays


@dataclass
class ScheduledRequest:
    """A request in this step: the runner caches its state across steps."""

    request: Request
    num_tokens: int            # tokens to compute this step
    new_block_ids: list[int]   # blocks added this step (all blocks when `is_new`)
    is_new: bool               # first step, or resumed after preemption (runner replaces its state)


@dataclass
class SchedulerOutput:
    """This step's requests: `decodes` (one token each, not new, in order) then `others`."""

    decodes: list[Request] = field(default_factory=list)
    decode_new_blocks: dict[str, list[int]] = field(default_factory=dict)  # only decodes that grew
    others: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)   # since the last step
    preempted_req_ids: set[str] = field(default_factory=set)
    # every request of `decodes` was also scheduled last step, and nothing else was
    # (besides `finished_req_ids`): the runner's rows need no other change
    decodes_were_scheduled: bool = False

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Every scheduled request as a `ScheduledRequest` (built on each access)."""
        new = self.decode_new_blocks
        return [ScheduledRequest(r, 1, new.get(r.request_id, []), False) for r in self.decodes] + self.others

    @property
    def total_num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_tokens for s in self.others)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.others


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
        # fast-path state: a mirror of `running` (None: rebuild when needed), whether
        # the last step scheduled exactly `running` as decodes, and whether the last
        # update left a prefill unfinished (then do not rebuild the mirror to find out)
        self._arrays: RunningArrays | None = None
        self._fast_last_step = False
        self._prefilling = False
        self.finished_in_update: list[Request] = []   # finished by the last update_from_output

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
        fast = self._schedule_decodes(out, budget)
        if fast:
            # only finishing (reported in finished_req_ids) removed requests since
            out.decodes_were_scheduled = self._fast_last_step
            budget -= len(out.decodes)
        else:
            self._arrays = None  # the general loop changes requests behind the mirror's back
            budget = self._schedule_running(out, budget)
        self._admit(out, budget)  # admitted requests join `running` after the mirrored rows
        self._fast_last_step = fast and not out.others
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> bool:
        """Schedule one token for every running request when each has exactly one
        token left to compute and the free blocks cover every block it needs
        (so the general loop would preempt nobody); False (nothing done) otherwise."""
        running = self.running
        n = len(running)
        if n == 0 or budget < n:
            return False
        a = self._arrays
        if a is None or len(a) != n:
            if self._prefilling:
                return False
            a = self._arrays = RunningArrays(running, self.kv.blocks, self.kv.block_size, self.max_model_len)
        if not a.all_decoding:
            return False
        nc = a.num_computed
        bs = self.kv.block_size
        grow = np.flatnonzero(nc >= a.capacity)
        if grow.size:
            need = int(((nc[grow] + bs) // bs - a.capacity[grow] // bs).sum())
            if need > self.kv.pool.num_free_blocks:
                return False
            for i in grow.tolist():
                req = running[i]
                out.decode_new_blocks[req.request_id] = self.kv.allocate(req, 1)
                a.capacity[i] = len(self.kv.blocks[req.request_id]) * bs
        out.decodes = list(running)
        if self.kv.enable_prefix_caching:
            # a decode completes a block only when it fills the block's last slot
            for i in np.flatnonzero((nc + 1) % bs == 0).tolist():
                self.kv.mark_computing(running[i], 1)
        return True

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """The general loop over running requests (chunks, block growth, preemption);
        returns the budget left."""
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
            out.others.append(ScheduledRequest(req, n, new_blocks, False))
            if caching:
                self.kv.mark_computing(req, n)
            budget -= n
            kept.append(req)
            i += 1
        kept.extend(self.running[i:])
        self.running = kept
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests while budget, max_num_seqs and blocks allow; returns the budget left."""
        chunked = self.config.enable_chunked_prefill
        caching = self.kv.enable_prefix_caching
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
            out.others.append(ScheduledRequest(req, n, list(self.kv.blocks[req.request_id]), is_new=True))
            if caching:
                self.kv.mark_computing(req, n)
            budget -= n
        return budget

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
    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[str, Sequence[int]],
                           decode_tokens: np.ndarray | None = None) -> list[Request]:
        """Advance progress, append sampled tokens, apply stop rules.

        `sampled`: request id -> new tokens; `decode_tokens`, when given, holds the
        token of each of `out.decodes` in order (then `sampled` may leave them out).
        Returns the scheduled requests that produced tokens (finished ones
        included), decodes first; `finished_in_update` lists those that finished."""
        self.finished_in_update = []
        self._prefilling = False
        decodes = out.decodes
        if decodes:
            if decode_tokens is None:
                decode_tokens = np.array([sampled[r.request_id][0] for r in decodes], np.int64)
            if self._arrays is not None and len(self._arrays) == len(decodes):
                updated = self._update_decodes(decodes, decode_tokens)
            else:  # a request was aborted while the step ran: the mirror is gone
                updated = self._update_general(
                    [ScheduledRequest(r, 1, [], False) for r in decodes],
                    {r.request_id: [t] for r, t in zip(decodes, decode_tokens.tolist())})
        else:
            updated = []
        if out.others:
            updated += self._update_general(out.others, sampled)
        a = self._arrays
        if a is not None and len(a) != len(self.running):  # requests were admitted after its rows
            if self._prefilling:
                self._arrays = None
            else:
                a.extend(RunningArrays(self.running[len(a):], self.kv.blocks, self.kv.block_size,
                                       self.max_model_len))
        return updated

    def _update_decodes(self, decodes: list[Request], tokens: np.ndarray) -> list[Request]:
        """`_update_general` for the fast path: every row of the mirror got one token."""
        for req, tok in zip(decodes, tokens.tolist()):
            req.output_token_ids.append(tok)
            req.num_computed_tokens += 1
        a = self._arrays
        a.num_computed += 1
        if self.kv.enable_prefix_caching:
            bs = self.kv.block_size
            for i in np.flatnonzero(a.num_computed % bs == 0).tolist():
                self.kv.cache_computed(decodes[i])
        check = a.may_stop(tokens).tolist()
        if check:
            done = []
            for i in check:
                req = decodes[i]
                self.check_stop(req)
                if req.finished:
                    done.append(i)
                    self.finished_in_update.append(req)
            if done:
                mask = np.ones(len(a), bool)
                mask[done] = False
                a.keep(mask)
            self._arrays = a   # the finished rows left the mirror as they left `running`
        return list(decodes)

    def _update_general(self, scheduled: list[ScheduledRequest],
                        sampled: Mapping[str, Sequence[int]]) -> list[Request]:
        updated = []
        cache = self.kv.cache_computed if self.kv.enable_prefix_caching else None
        for s in scheduled:
            req = s.request
            if req.finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_tokens
            if cache is not None:
                cache(req)
            tokens = sampled.get(req.request_id)
            if not tokens:
                self._prefilling = True
                continue  # partial prefill: nothing sampled yet
            req.output_token_ids.extend(tokens)
            self.check_stop(req)
            if req.finished:
                self.finished_in_update.append(req)
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
            self._arrays = None  # (the fast path's update removes the row itself)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        req.finished = True
        req.stop_reason = stop_reason
        self.kv.free(req)
        self._finished.add(req.request_id)
        del self.requests[req.request_id]
