"""Continuous batching: who runs this step, with how many tokens.

One token budget covers prefills and decodes alike (chunked prefill splits a
long prompt over steps). Running requests go first, in arrival order; when the
block pool cannot hold the step, the newest running request is preempted (its
blocks freed, recomputed later; it keeps its slot). Waiting requests are
admitted while budget, `max_num_seqs` and blocks allow. With the "priority"
policy (vLLM V1's), the waiting queue is kept sorted by (priority, arrival) —
lower value first — and the running request preempted is the one with the
largest (priority, arrival); "fcfs" keeps a plain arrival-order queue.
A request whose grammar is still compiling (status WAITING_FOR_FSM, vLLM's
name) is held aside in `waiting_for_fsm`, never looked at by `schedule()`,
until `grammar_ready()` queues it as a newly waiting request.
With prefix caching, a waiting request whose prefix continues into blocks
another request computes this step waits one step and then takes them from
the cache, so a shared prefix is computed once.

There is one path. The running requests' progress lives in slot-indexed arrays
(`SlotArrays`), so a step's token counts, block needs and stop candidates are
array operations; Python touches only the rows that need a block, complete a
cached block, or may stop — and, unavoidably, appends each new token to its
request's output list.

`schedule()` advances each scheduled row's progress at once and counts the token
a row will sample as a placeholder (vLLM's `num_output_placeholders`), so the
next `schedule()` may run before this step's `update()` — asynchronous
scheduling: a running request is then scheduled for the token still in flight
(its stop rules are applied one step late, by `update()`; the extra token of a
request that stopped is dropped), except one whose placeholder already reaches
its length limit. A request finished or aborted while its step was in flight
gets nothing from that step; one preempted meanwhile keeps the token.

Speculative decoding: a decoding request with draft tokens (proposed by the
runner after its last step, `update(..., draft_token_ids=...)`) is scheduled
1 + drafts tokens; drafts take the budget left after every running request's
own tokens, in order. `update` then appends the accepted drafts and the
sampled token (stop rules apply to them in order; tokens after a stop are
dropped) and rolls progress back to the accepted positions: the KV written at
rejected positions is overwritten later; the blocks stay with the request
(`SlotArrays.num_blocks`) and are registered in the prefix cache only once
their every position is accepted. Not combined with asynchronous scheduling.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from polyrunner.config import SchedulerConfig
from polyrunner.engine.kv_manager import KVCacheManager
from polyrunner.engine.request import Request, RequestStatus
from polyrunner.engine.slots import SlotArrays
from polyrunner.numeric import cumsum_and_arange
from polyrunner.spec_decode.metrics import SpecDecodingStats
from polyrunner.step_channel import NO_ROWS, NewRequest, SchedulerOutput


@dataclass
class StepUpdate:
    """What `Scheduler.update` did: `advanced` got a new token (row order),
    `finished` ended (length, EOS, stop ids) this step."""

    advanced: list[Request]
    finished: list[Request]
    num_new: list[int] | None = None   # tokens appended per advanced request (None: one each)


@dataclass(slots=True)
class RunningPlan:
    """The running requests a step schedules (row order): their slots, token counts and
    computed tokens, the step's total token count, and the draft tokens among each row's
    count (None: no drafts this step)."""

    rows: list[Request]
    slots: np.ndarray
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    total: int
    drafts: np.ndarray | None


def _priority_key(req: Request) -> tuple[int, int]:
    return req.priority, req.arrival


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 num_speculative_tokens: int = 0, max_loras: int | None = None) -> None:
        """`max_loras`: the most distinct adapters the running requests may use (None: LoRA off)."""
        self.config = config
        self.max_loras = max_loras
        self.kv = kv
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_stats = SpecDecodingStats()
        self.slots = SlotArrays(config.max_num_seqs, max_model_len, num_speculative_tokens)
        self.waiting: deque[Request] = deque()
        self.waiting_for_fsm: dict[str, Request] = {}   # grammar still compiling: not schedulable
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.by_priority = config.policy == "priority"
        self._arrivals = itertools.count()
        self._running_slots: np.ndarray | None = None   # slots of `running`, rebuilt on change
        self._num_finished = 0                  # requests finished so far
        self._finished_slots: list[int] = []    # freed since the last step: the next step tells the runner
        self.num_in_flight = 0                  # steps scheduled and not yet updated
        self.removed_loras: list[int] = []      # adapters removed since the last step: the next step tells the runner

    # ---- admission -------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue `req`; one with status WAITING_FOR_FSM waits aside for `grammar_ready`."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        if req.status == RequestStatus.WAITING_FOR_FSM:
            self.waiting_for_fsm[req.request_id] = req
        else:
            self._enqueue(req)

    def grammar_ready(self, req: Request) -> None:
        """`req`'s grammar compiled: it joins the waiting queue (as if it arrived now)."""
        if self.waiting_for_fsm.pop(req.request_id, None) is not None:
            req.status = RequestStatus.WAITING
            self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        req.arrival = next(self._arrivals)
        if self.by_priority:
            bisect.insort(self.waiting, req, key=_priority_key)
        else:
            self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted; returns it (its slot already freed), or None."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_fsm)

    def has_finished_requests(self) -> bool:
        """Finished requests whose slots the runner has not been told of yet (vLLM's name), or
        removed adapters: the next `schedule()` hands them over, even without rows to run."""
        return bool(self._finished_slots or self.removed_loras)

    @property
    def num_waiting(self) -> int:
        """Requests not running: queued, preempted, or waiting for their grammar."""
        return len(self.waiting) + len(self.waiting_for_fsm)

    def _slots_of_running(self) -> np.ndarray:
        if self._running_slots is None:
            self._running_slots = np.fromiter((r.slot for r in self.running), np.int64, len(self.running))
        return self._running_slots

    # ---- one step --------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step. May be called again before this step's `update` (see the
        module docstring); every non-empty step must be updated, in order."""
        out = SchedulerOutput(num_finished_at_schedule=self._num_finished, finished_slots=self._finished_slots,
                              removed_loras=self.removed_loras)
        self._finished_slots, self.removed_loras = [], []
        budget = self.config.max_num_batched_tokens
        plan = self._schedule_running(out, budget)
        rows, slots, counts, computed = plan.rows, plan.slots, plan.num_scheduled, plan.num_computed
        drafts = plan.drafts
        admitted = self._admit(out, budget - plan.total)
        if not admitted:
            if not rows:
                return out
            if plan.total == len(rows):   # all decodes: already decode-first
                out.requests, out.slots, out.num_scheduled, out.num_computed = rows, slots, counts, computed
                return self._advance(out)
        else:
            new_slots = np.array([r.slot for r, _ in admitted], np.int64)
            rows = rows + [r for r, _ in admitted]
            slots = np.concatenate([slots, new_slots])
            counts = np.concatenate([counts, np.array([n for _, n in admitted], np.int64)])
            computed = np.concatenate([computed, self.slots.num_computed[new_slots]])
            if drafts is not None:
                drafts = np.concatenate([drafts, np.zeros(len(admitted), np.int64)])
        if (counts > 1).any():   # decodes first (stable)
            order = np.argsort(counts > 1, kind="stable")
            rows = [rows[i] for i in order.tolist()]
            slots, counts, computed = slots[order], counts[order], computed[order]
            if drafts is not None:
                drafts = drafts[order]
        out.requests, out.slots, out.num_scheduled, out.num_computed = rows, slots, counts, computed
        if drafts is not None:
            out.num_draft_tokens, out.draft_token_ids = drafts, self.slots.draft_ids[slots]
        return self._advance(out)

    def _advance(self, out: SchedulerOutput) -> SchedulerOutput:
        """Count the step as done: progress moves by the scheduled tokens, and each
        row that completes its sequence holds a placeholder for its sampled token."""
        a = self.slots
        slots = out.slots
        nc = out.num_computed + out.num_scheduled
        a.num_computed[slots] = nc
        out.samples = samples = nc >= a.num_tokens[slots]
        a.num_tokens[slots] += samples
        if out.num_draft_tokens is not None:
            a.num_drafts[slots] = 0   # consumed; `update` brings the next ones
        self.num_in_flight += 1
        return out

    def _plan(self, want: np.ndarray, budget: int) -> np.ndarray:
        """Tokens for each running request (in order) under the budget, from the
        tokens each still has to compute."""
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            want = np.minimum(want, threshold)
        if int(want.sum()) <= budget:
            return want
        take = np.zeros_like(want)
        chunked = self.config.enable_chunked_prefill
        for i, w in enumerate(want.tolist()):   # the budget runs out this step
            if budget <= 0:
                break
            n = min(w, budget)
            if n < w and not chunked:
                continue
            take[i] = n
            budget -= n
        return take

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> RunningPlan:
        """Plan the running requests, preempting the newest while the blocks the plan
        needs exceed the free ones; allocate."""
        bs = self.kv.block_size
        a = self.slots
        use_drafts = self.num_speculative_tokens > 0
        while self.running:
            slots = self._slots_of_running()
            nc = a.num_computed[slots]
            want = a.num_tokens[slots] - nc
            ended = None
            if self.num_in_flight:   # a request whose token in flight ends it by length runs no more
                ended = a.num_tokens[slots] >= a.length_limit[slots]
                want[ended] = 0
            total = int(want.sum())
            drafts = a.num_drafts[slots] if use_drafts else None
            if drafts is not None and not drafts.any():
                drafts = None
            held = a.num_blocks[slots]   # cdiv(num_computed, block_size), or more after a rollback
            if (drafts is None and total == len(slots) and total <= budget
                    and (ended is None or not ended.any())):   # all decodes: one token each
                take, need = want, None
                grow = np.flatnonzero(nc // bs >= held)   # ... whose position starts a block
                num_needed = len(grow)
            else:
                take = self._plan(want, budget)
                if drafts is not None:
                    drafts = self._fit_drafts(drafts * ((take == want) & (want == 1)), budget - int(take.sum()))
                    take = take + drafts
                total = int(take.sum())
                need = np.maximum((nc + take + bs - 1) // bs - held, 0)
                grow = np.flatnonzero(need)
                num_needed = int(need[grow].sum())
            if num_needed <= self.kv.pool.num_free_blocks:
                break
            if drafts is not None:   # drop the drafts before preempting anybody for them
                use_drafts = False
                continue
            self._preempt(self._victim(), out)
        else:
            return RunningPlan([], NO_ROWS, NO_ROWS, NO_ROWS, 0, None)
        running = self.running
        for i in grow.tolist():
            req = running[i]
            new = self.kv.allocate(req, int(take[i]))
            assert req.slot is not None and new is not None   # running: slotted; num_needed blocks are free
            out.new_block_ids[req.slot] = new
            a.num_blocks[req.slot] = len(self.kv.blocks[req.request_id])
        if drafts is not None and not drafts.any():
            drafts = None
        if self.kv.enable_prefix_caching:
            for i in np.flatnonzero((nc + take) // bs > nc // bs).tolist():
                req = running[i]   # a token still in flight is not known yet: no key for its block
                self.kv.mark_computing(req, min(int(take[i]), req.num_tokens - int(nc[i])))
        if need is None or take.all():
            return RunningPlan(list(running), slots, take, nc, total, drafts)
        keep = np.flatnonzero(take)
        return RunningPlan([running[i] for i in keep.tolist()], slots[keep], take[keep], nc[keep], total,
                           None if drafts is None else drafts[keep])

    @staticmethod
    def _fit_drafts(drafts: np.ndarray, budget: int) -> np.ndarray:
        """Draft tokens per row that fit in `budget`, given in row order."""
        before = np.cumsum(drafts) - drafts
        fitted: np.ndarray = np.clip(budget - before, 0, drafts)
        return fitted

    def _admit(self, out: SchedulerOutput, budget: int) -> list[tuple[Request, int]]:
        """Admit waiting requests while budget, max_num_seqs and blocks allow;
        returns them with their token counts."""
        admitted: list[tuple[Request, int]] = []
        chunked = self.config.enable_chunked_prefill
        caching = self.kv.enable_prefix_caching
        loras = self._running_loras()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if out.preempted_req_ids:
                break  # memory is short this step; admit nobody new
            req = self.waiting[0]
            if loras is not None and not self._lora_fits(req, loras):
                fits = next((r for r in self.waiting if self._lora_fits(r, loras)), None)
                if fits is None:
                    break
                req = fits   # vLLM's rule: skip requests whose adapter would exceed max_loras
            if req.slot is None and not self.slots.num_free:
                # every slot is held, some by preempted requests (priority order can put a
                # newcomer ahead of them): resume one of those first
                preempted = next((r for r in self.waiting if r.slot is not None
                                  and (loras is None or self._lora_fits(r, loras))), None)
                if preempted is None:
                    break
                req = preempted
            resumed = req.slot is not None
            if not resumed:
                self.slots.assign(req)
            assert req.slot is not None   # resumed, or assigned just now
            hit = self.kv.take_cached_prefix(req)
            if hit is None:   # its prefix is being computed this step: hit it next step
                self._undo_admission(req, resumed)
                break
            req.num_computed_tokens = req.num_cached_tokens = hit
            n = req.num_tokens - req.num_computed_tokens
            threshold = self.config.long_prefill_token_threshold
            n = min(n, threshold, budget) if threshold > 0 else min(n, budget)
            if not chunked and n < req.num_tokens - req.num_computed_tokens:
                self._undo_admission(req, resumed)
                break
            if self.kv.allocate(req, n) is None:
                self._undo_admission(req, resumed)
                break
            self.slots.num_blocks[req.slot] = len(self.kv.blocks[req.request_id])
            if req is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._running_slots = None
            out.reset_block_slots.append(req.slot)
            out.new_block_ids[req.slot] = self.kv.block_ids(req)
            if not resumed:
                out.new_requests.append(NewRequest(req.request_id, req.slot, req.prompt_token_ids,
                                                   req.params, req.eos_token_ids, req.bad_words_token_ids,
                                                   req.lora_request))
            if caching:
                self.kv.mark_computing(req, n)
            if loras is not None and req.lora_id:
                loras.add(req.lora_id)
            admitted.append((req, n))
            budget -= n
        return admitted

    def _running_loras(self) -> set[int] | None:
        """The adapter ids of the running requests (None: LoRA is off)."""
        if self.max_loras is None:
            return None
        return {r.lora_id for r in self.running if r.lora_id}

    def _lora_fits(self, req: Request, loras: set[int]) -> bool:
        assert self.max_loras is not None
        return not req.lora_id or req.lora_id in loras or len(loras) < self.max_loras

    def _undo_admission(self, req: Request, resumed: bool) -> None:
        """Give back a prefix-cache claim (and a fresh slot) of a request not admitted."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        if not resumed:
            self.slots.release(req)

    def _victim(self) -> Request:
        """Take the running request to preempt off `running`: the newest (fcfs), or the
        one with the largest (priority, arrival)."""
        if not self.by_priority:
            return self.running.pop()
        victim = max(self.running, key=_priority_key)
        self.running.remove(victim)
        return victim

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        self.slots.num_blocks[req.slot] = self.slots.num_drafts[req.slot] = 0
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            bisect.insort(self.waiting, req, key=_priority_key)
        else:
            self.waiting.appendleft(req)
        self._running_slots = None
        out.preempted_req_ids.add(req.request_id)

    # ---- after the step ----------------------------------------------------
    def update(self, out: SchedulerOutput, tokens: np.ndarray, num_sampled: np.ndarray | None = None,
               draft_token_ids: np.ndarray | None = None, num_draft_tokens: np.ndarray | None = None
               ) -> StepUpdate:
        """Append `tokens[i]` to every row i whose sequence the step completed
        (`out.samples`; the other rows ran a partial prefill and their token is
        ignored) and whose request is not finished; apply length / EOS / stop-id rules.
        Speculative decoding: `tokens` [R, k + 1] with `num_sampled` [R] tokens per
        row (accepted drafts + 1), and the drafts proposed for each row's next step
        (`draft_token_ids` [R, k], `num_draft_tokens` [R]); see the module docstring."""
        if not out.num_reqs:
            return StepUpdate([], [])
        if num_sampled is not None:
            return self._update_spec(out, tokens, num_sampled, draft_token_ids, num_draft_tokens)
        a = self.slots
        reqs, slots = out.requests, out.slots
        self.num_in_flight -= 1
        nc = out.num_computed + out.num_scheduled
        done = out.samples
        if self._num_finished != out.num_finished_at_schedule:   # finished while the step ran
            done = done & np.fromiter((not r.finished for r in reqs), bool, len(reqs))
        if done.all():
            advanced, adv_slots, adv_tokens, adv_nt = list(reqs), slots, tokens[:len(reqs)], nc + 1
        else:
            rows = np.flatnonzero(done)
            advanced = [reqs[i] for i in rows.tolist()]
            adv_slots, adv_tokens, adv_nt = slots[rows], tokens[rows], nc[rows] + 1
        for req, tok in zip(advanced, adv_tokens.tolist()):
            req.output_token_ids.append(tok)
        if self.kv.enable_prefix_caching:
            bs = self.kv.block_size
            for i in np.flatnonzero(nc // bs > out.num_computed // bs).tolist():
                if not reqs[i].finished:
                    self.kv.cache_computed(reqs[i])
        finished = []
        for i in a.may_stop(adv_slots, adv_tokens, adv_nt).tolist():
            req = advanced[i]
            self.check_stop(req)
            if req.finished:
                finished.append(req)
        return StepUpdate(advanced, finished)

    def check_stop(self, req: Request) -> None:
        """max_tokens / max_model_len -> length; EOS / stop_token_ids -> stop."""
        outputs = req.output_token_ids
        last = outputs[-1]
        params = req.params
        n_out = len(outputs)
        if n_out >= params.min_tokens:
            if last in req.eos_token_ids and not params.ignore_eos:
                self.finish(req, RequestStatus.FINISHED_STOPPED, None)
                return
            if params.stop_token_ids and last in params.stop_token_ids:
                self.finish(req, RequestStatus.FINISHED_STOPPED, last)
                return
        if n_out >= req.max_tokens or len(req.prompt_token_ids) + n_out >= self.max_model_len:
            self.finish(req, RequestStatus.FINISHED_LENGTH)

    def stop_at(self, req: Request, num_output_tokens: int, stop: str) -> None:
        """A stop string ended `req`'s text after its first `num_output_tokens` output tokens
        (the later ones are dropped): it finishes as stopped with `stop` as its reason, also
        when the length / EOS rules already finished it this step (the stop string wins)."""
        del req.output_token_ids[num_output_tokens:]
        if req.finished:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        else:
            self.finish(req, RequestStatus.FINISHED_STOPPED, stop)

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End an unfinished request: frees its blocks and slot (the next step tells the runner)."""
        assert not req.finished, f"request {req.request_id!r} finished twice"
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._running_slots = None
        elif req.status == RequestStatus.WAITING_FOR_FSM:
            self.waiting_for_fsm.pop(req.request_id, None)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.holds_slot:   # the runner holds state for it (admitted at least once)
            assert req.slot is not None
            self._finished_slots.append(req.slot)
        req.status = status
        self._num_finished += 1
        req.stop_reason = stop_reason
        self.kv.free(req)
        self.slots.release(req)
        del self.requests[req.request_id]

    def _update_spec(self, out: SchedulerOutput, tokens: np.ndarray, num_sampled: np.ndarray,
                     draft_token_ids: np.ndarray | None, num_draft_tokens: np.ndarray | None) -> StepUpdate:
        """`update` with several tokens per row (speculative decoding; synchronous only)."""
        a = self.slots
        self.num_in_flight -= 1
        rows = np.flatnonzero(out.samples)
        reqs = out.requests
        advanced = [reqs[i] for i in rows.tolist()]
        adv_slots = out.slots[rows]
        ns = num_sampled[rows].astype(np.int64)
        sched = np.zeros(len(rows), np.int64) if out.num_draft_tokens is None else out.num_draft_tokens[rows]
        before = out.num_computed[rows] + out.num_scheduled[rows] - sched   # tokens before this step's
        if out.num_draft_tokens is not None:
            drafted = sched > 0
            self.spec_stats.observe(int(drafted.sum()), int(sched.sum()), int((ns - 1)[drafted].sum()))
        num_tokens = before + ns
        a.num_tokens[adv_slots] = num_tokens
        a.num_computed[adv_slots] = num_tokens - 1   # rejected positions rolled back
        # stop candidates among the new tokens, in order (flattened row-major)
        flat_row = np.repeat(np.arange(len(rows)), ns)
        flat_pos = cumsum_and_arange(ns)[1]
        flat_tok = tokens[rows[flat_row], flat_pos]
        cand = a.may_stop(adv_slots[flat_row], flat_tok, before[flat_row] + flat_pos + 1)
        stops: dict[int, list[int]] = {}
        for r, j in zip(flat_row[cand].tolist(), flat_pos[cand].tolist()):
            stops.setdefault(r, []).append(j)
        finished, num_new = [], []
        for i, (req, toks) in enumerate(zip(advanced, tokens[rows].tolist())):
            toks = toks[:int(ns[i])]
            done = 0   # tokens appended so far
            for j in stops.get(i, ()):
                req.output_token_ids.extend(toks[done:j + 1])
                done = j + 1
                self.check_stop(req)
                if req.finished:   # the tokens after the stop are dropped
                    finished.append(req)
                    break
            else:
                req.output_token_ids.extend(toks[done:])
                done = len(toks)
            num_new.append(done)
        if self.kv.enable_prefix_caching:
            bs = self.kv.block_size
            for i in np.flatnonzero((num_tokens - 1) // bs > out.num_computed[rows] // bs).tolist():
                if not advanced[i].finished:
                    self.kv.cache_computed(advanced[i])
        if num_draft_tokens is not None and draft_token_ids is not None and len(rows):
            room = a.length_limit[adv_slots] - num_tokens - 1   # the step after samples one more
            a.num_drafts[adv_slots] = np.clip(np.minimum(num_draft_tokens[rows], room), 0, None)
            a.draft_ids[adv_slots] = draft_token_ids[rows]
        return StepUpdate(advanced, finished, num_new)
