"""LLMEngine: validate and admit requests, step the scheduler and the runner,
return outputs. One `step()` runs one batch; with asynchronous scheduling
(`async_scheduling`, by default the backend's capability) it first queues the
next batch, so the host schedules and prepares step N+1 while step N runs on the
device, and returns step N's outputs.

Structured-output grammars compile in a worker pool (`GrammarCompilePool`).
`add_request(..., wait_for_grammar=False)` (the serving loop's way) returns at
once: the request waits in status WAITING_FOR_FSM, skipped by the scheduler,
while the others step; each `step()` first collects the grammars that became
ready (those requests are queued) and the requests whose grammar failed or ran
past `grammar_compile_timeout_s` (they finish alone with a ValueError's
message as their `error`, listed in `rejected`). The default
`wait_for_grammar=True` blocks for the grammar instead and raises the ValueError
from `add_request`, as for any invalid parameter."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from polyrunner.config import EngineConfig
from polyrunner.device.backend import Backend
from polyrunner.distributed.launch import start_tensor_parallel
from polyrunner.distributed.workers import TPDriver, TPDriverRunner
from polyrunner.engine.kv_manager import KVCacheManager
from polyrunner.engine.model_setup import LoadedModel, load_runner
from polyrunner.engine.output_processor import OutputProcessor
from polyrunner.engine.request import Request, RequestStatus
from polyrunner.engine.scheduler import Scheduler
from polyrunner.engine.tokenizer import Tokenizer
from polyrunner.lora.registry import AdapterRegistry
from polyrunner.lora.request import LoRARequest
from polyrunner.numeric import cdiv
from polyrunner.outputs import RequestOutput
from polyrunner.plugins import create_backend
from polyrunner.prompt import Prompt
from polyrunner.runner.async_output import AsyncModelRunnerOutput
from polyrunner.sampling_params import SamplingParams
from polyrunner.spec_decode.metrics import SpecDecodingStats
from polyrunner.step_channel import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:   # imported with the first structured-output request
    from polyrunner.structured.compile_pool import GrammarCompilePool

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.02   # a step with only grammars to wait for sleeps at most this long for one

_EMPTY_PROMPT = "The decoder prompt cannot be empty"   # vLLM's wording


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        self.grammar_pool: GrammarCompilePool | None = None   # made with the first structured-output request
        self.backend = create_backend(config)   # adjusts `config` for the backend first
        self._check_speculative()
        self.async_scheduling = self._async_scheduling()
        self.tp_driver = start_tensor_parallel(config, self.backend)   # None: one device
        tp = None if self.tp_driver is None else self.tp_driver.tp
        try:
            loaded: LoadedModel = load_runner(config, self.backend, tp) if self.tp_driver is None else \
                self.tp_driver.guarded(lambda: load_runner(config, self.backend, tp))
        except BaseException:
            self.shutdown()
            raise
        self.model_folder, self.arch, self.max_model_len = loaded.folder, loaded.arch, loaded.max_model_len
        self.dtype, self.quantization = loaded.dtype, loaded.quantization
        self.tokenizer = Tokenizer.from_folder_or_none(config.model.tokenizer or self.model_folder)
        self.runner = loaded.runner if self.tp_driver is None else TPDriverRunner(loaded.runner, self.tp_driver)
        num_blocks = loaded.num_blocks
        if self.tp_driver is not None:   # the workers stop with the engine (or at exit)
            weakref.finalize(self, _stop_tensor_parallel, self.tp_driver, self.backend)
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        spec = config.speculative
        self.loras = AdapterRegistry(config.lora, self.arch)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len,
                                   spec.num_speculative_tokens if spec is not None else 0,
                                   None if config.lora is None else config.lora.max_loras)
        self.outputs = OutputProcessor(self.tokenizer)
        self._eos = self._eos_ids()
        self._ids = itertools.count()
        self._in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None   # asynchronous only
        self._grammar_waiters: dict[str, list[Request]] = {}   # request id -> its children, while compiling
        self.rejected: list[tuple[str, ValueError]] = []   # failed for their grammar in the last step()
        logger.info("engine ready in %.1f s: backend=%s dtype=%s max_model_len=%d kv_blocks=%d async_scheduling=%s",
                    time.perf_counter() - start, self.backend.name, self.dtype, self.max_model_len, num_blocks,
                    self.async_scheduling)

    def _check_speculative(self) -> None:
        """Speculative decoding runs with synchronous steps, on a backend
        whose steps may take any token count (a ValueError names what conflicts)."""
        if self.config.speculative is None:
            return
        if self.config.scheduler.async_scheduling:
            raise ValueError("async_scheduling=True cannot be combined with speculative_config (the next "
                             "step's drafts depend on this step's accepted tokens); allowed with "
                             "speculative decoding: False or None")
        if self.backend.capabilities.static_shapes:
            raise ValueError(f"speculative_config is not supported by backend {self.backend.name!r}: its "
                             "steps are precompiled for static shapes, and verification steps (1 + "
                             "num_speculative_tokens logits rows per request) are not among its buckets")

    def speculative_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding counters (`SpecDecodingStats`: acceptance_rate,
        mean_acceptance_length), or None without speculative decoding."""
        return self.scheduler.spec_stats if self.config.speculative is not None else None

    def _async_scheduling(self) -> bool:
        """The configured `async_scheduling`, else the backend's capability; True on a
        backend without the capability is a ValueError."""
        wanted = self.config.scheduler.async_scheduling
        able = self.backend.capabilities.async_scheduling
        if self.config.parallel.tensor_parallel_size > 1:   # workers run each step as it is sent
            if wanted:
                raise ValueError("async_scheduling=True does not support tensor_parallel_size > 1; "
                                 "allowed with tensor parallelism: False or None")
            return False
        if self.config.speculative is not None:   # checked above: wanted is not True
            return False
        if wanted and not able:
            raise ValueError(f"async_scheduling=True is not supported by backend {self.backend.name!r} "
                             "(its Capabilities.async_scheduling is False: the device->host copy of "
                             "sampled tokens blocks); allowed: False or None")
        return able if wanted is None else wanted

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device). Idempotent."""
        if self.tp_driver is not None:
            _stop_tensor_parallel(self.tp_driver, self.backend)
        if self.grammar_pool is not None:
            self.grammar_pool.shutdown()

    def _eos_ids(self) -> frozenset[int]:
        ids = set(self.arch.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return frozenset(ids)

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None for a model without one), as vLLM's."""
        return self.tokenizer

    # ---- requests ---------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = False, priority: int = 0, *,
                    wait_for_grammar: bool = True, lora_request: LoRARequest | None = None) -> str:
        """Validate and queue a request; raises ValueError before anything is scheduled.
        `stream`: `step()` reports it every step, not only when finished.
        `priority`: with scheduling_policy="priority", lower values run first.
        `wait_for_grammar`: with structured outputs, True compiles the grammar now
        (ValueError if invalid or past the time limit); False returns at once and
        the grammar compiles off the step (see the module docstring).
        `lora_request`: the adapter to run with (needs LoRA enabled; read and checked against
        the model the first time its id is seen)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        text, ids = self._tokenize(prompt)
        self._validate(ids, params)
        self._check_priority(priority)
        self.loras.check(lora_request)
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.model_copy(
                    update={"n": 1, "seed": None if params.seed is None else params.seed + i})
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(child_id, list(ids), child_params, max_tokens, self._eos, text, priority=priority,
                            lora_request=lora_request)
            if params.bad_words:
                assert self.tokenizer is not None   # `_validate` checked
                child.bad_words_token_ids = params.bad_words_token_ids(self.tokenizer)
            children.append(child)
        if params.structured_outputs is not None:
            self._attach_grammar(request_id, params, children, wait_for_grammar)
        self.outputs.add(request_id, children, stream)
        for child in children:
            self.scheduler.add_request(child)
        return request_id

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a string, {"prompt_token_ids": [...]} (with an
        optional "prompt" text) or {"prompt": text}, vLLM's prompt forms."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
            if not prompt:
                raise ValueError(_EMPTY_PROMPT)
            return prompt, self.tokenizer.encode(prompt)
        raise ValueError("prompt must be a string or a dict with 'prompt_token_ids'")

    def _token_ids(self, ids: Any) -> list[int]:
        """`prompt_token_ids` as a list of ints; anything else (floats, strings, bools,
        nesting) is a ValueError naming the field, the value and the allowed range."""
        top = self.arch.vocab_size - 1
        what = f"prompt_token_ids must be a list of integers in the allowed range [0, {top}]"
        if isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind in "iu":
            as_list: list[int] = ids.tolist()
            return as_list
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"{what} (got {type(ids).__name__} {_short(ids)})")
        if all(type(t) is int for t in ids):
            return list(ids)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"{what} (got {_short(t)} of type {type(t).__name__} at index {i})")
        return [int(t) for t in ids]

    def _check_priority(self, priority: Any) -> None:
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority must be an integer (got {_short(priority)})")
        if priority != 0 and self.config.scheduler.policy != "priority":   # vLLM's wording
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.arch.vocab_size
        if not ids:
            raise ValueError(_EMPTY_PROMPT)
        if min(ids) < 0 or max(ids) >= vocab:   # vLLM: "Token id {id} is out of vocabulary"
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"Token id {bad} is out of vocabulary: prompt_token_ids allowed range is "
                             f"[0, {vocab - 1}]")
        max_n = self.config.scheduler.max_num_seqs
        if params.n > max_n:
            raise ValueError(f"n must be in [1, {max_n}] (got {params.n}): a request's n completions must fit "
                             f"in one batch of max_num_seqs={max_n} sequences; raise max_num_seqs for more")
        self._validate_logprobs(params)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             f"so the prompt may have at most {self.max_model_len - 1}")
        params.validate_for_vocab(vocab)
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this model has none (use logit_bias instead)")
        missing = params.features(self.config.model.logprobs_mode) - self.backend.capabilities.sampling
        if missing:
            raise ValueError(f"backend {self.backend.name!r} does not support sampling features "
                             f"{sorted(missing)} on its device")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this model has none")
        total = min(self.max_model_len, len(ids) + (params.max_tokens or self.max_model_len))
        need = cdiv(total, self.config.cache.block_size)
        if need > self.kv.pool.num_usable_blocks:
            raise ValueError(f"request needs {need} KV blocks but the cache holds only "
                             f"{self.kv.pool.num_usable_blocks}; raise kv_cache_memory_bytes")

    # ---- structured-output grammars ------------------------------------------------
    def _attach_grammar(self, request_id: str, params: SamplingParams, children: list[Request],
                        wait: bool) -> None:
        """Give the children the request's compiled grammar when it is cached (or, with
        `wait`, once compiled); else they wait in status WAITING_FOR_FSM while it
        compiles in the pool. ValueError naming the field (`structured_outputs.json`,
        ...) for a constraint found invalid now."""
        if self.grammar_pool is None:
            from polyrunner.structured.compile_pool import GrammarCompilePool
            from polyrunner.structured.compiler import LazyGrammarCompiler
            self.grammar_pool = GrammarCompilePool(
                LazyGrammarCompiler(self.tokenizer, self.arch.vocab_size, self._eos),
                self.config.scheduler.grammar_compile_timeout_s)
        assert params.structured_outputs is not None   # `add_request` checked
        grammar = self.grammar_pool.submit(request_id, params.structured_outputs)
        if grammar is None and wait:
            grammar = self.grammar_pool.result(request_id)
        if grammar is None:
            self._grammar_waiters[request_id] = children
        for child in children:
            if grammar is None:
                child.status = RequestStatus.WAITING_FOR_FSM
            else:
                assert child.params.structured_outputs is not None   # a copy of `params`
                child.params.structured_outputs.compiled = grammar

    def _collect_grammars(self) -> list[RequestOutput]:
        """Queue the requests whose grammar is ready; fail those whose grammar failed
        (recorded in `rejected`) and return their outputs."""
        assert self.grammar_pool is not None   # called only with a pool
        ready, failed = self.grammar_pool.poll()
        for rid, grammar in ready:
            for child in self._grammar_waiters.pop(rid, ()):
                assert child.params.structured_outputs is not None   # it waited for this grammar
                child.params.structured_outputs.compiled = grammar
                self.scheduler.grammar_ready(child)
        if not failed:
            return []
        ended: list[Request] = []
        for rid, error in failed:
            children = self._grammar_waiters.pop(rid, [])
            logger.warning("request %s rejected: %s", rid, error)
            for child in children:
                self.scheduler.finish(child, RequestStatus.FINISHED_ERROR)
                child.error = str(error)
            ended += children
            self.rejected.append((rid, error))
        return self.outputs.outputs_for(ended, ended)

    def _only_grammars_left(self) -> bool:
        """Nothing to run but requests waiting for their grammar."""
        sched = self.scheduler
        return (self._in_flight is None and not sched.running and not sched.waiting
                and bool(sched.waiting_for_fsm))

    def _validate_logprobs(self, params: SamplingParams) -> None:
        """vLLM's `max_logprobs` check and wording (-1 asks for the whole vocabulary, allowed
        only when max_logprobs is -1 or at least the vocabulary size)."""
        vocab = self.arch.vocab_size
        limit = self.config.model.max_logprobs
        limit = vocab if limit == -1 else limit
        for kind, asked in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if asked:
                asked = vocab if asked == -1 else asked
                if asked > limit:
                    raise ValueError(f"Requested {kind} logprobs of {asked}, which is greater than max "
                                     f"allowed: {limit}")

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its `n` completions); frees its blocks and slot at once
        (one waiting for its grammar: its compile is cancelled or its result dropped)."""
        if self._grammar_waiters.pop(request_id, None) is not None:
            assert self.grammar_pool is not None   # waiters come from the pool
            self.grammar_pool.cancel(request_id)
        for child in self.outputs.children(request_id):
            self.scheduler.abort(child)   # the next step tells the runner
        self.outputs.drop(request_id)

    # ---- adapters (vLLM's names) ---------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (ValueError if it cannot serve); False if its id is
        already loaded with that folder."""
        if self.config.lora is None:
            self.loras.check(lora_request)   # raises: not enabled
        return self.loras.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter `lora_id` (the runners drop it with the next step); False if unknown."""
        removed = self.loras.remove(lora_id)
        if removed:
            self.scheduler.removed_loras.append(lora_id)
        return removed

    def list_loras(self) -> set[int]:
        return self.loras.ids()

    def has_unfinished_requests(self) -> bool:
        """Requests still to finish, or (asynchronous scheduling) a step still in flight.
        Finished requests' runner state is dropped by the next step (vLLM's
        `finished_req_ids`), whenever that comes."""
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    def has_requests(self) -> bool:
        """Work for `step()`: unfinished requests, a step in flight, or finished requests
        whose slots the runner is still to be told of (a step without rows hands them
        over). Loops that run the engine until idle test this (vLLM's engine core steps
        while its scheduler `has_requests()`)."""
        return self.has_unfinished_requests() or self.scheduler.has_finished_requests()

    # ---- stepping -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch: schedule -> execute -> update -> outputs -> finish stop-string
        hits. Returns the outputs of requests that advanced (streaming ones every
        step, the others once finished). Finished requests' state leaves the
        runner with the next step (`SchedulerOutput.finished_slots`; a step without
        rows when nothing else runs). Asynchronously, the batch whose outputs return
        is the one queued by the previous call (the first call queues two), and
        its stop rules apply after the next batch was queued: a request that
        stopped ran one extra token there, which is dropped. Requests whose
        grammar failed come first (see the module docstring); with nothing but
        grammars to wait for, the step sleeps up to GRAMMAR_POLL_S for one."""
        self.rejected = []
        failed: list[RequestOutput] = [] if self.grammar_pool is None else self._collect_grammars()
        if self.async_scheduling:
            outs = self._step_async()
        else:
            so = self.scheduler.schedule()
            outs = [] if so.is_empty else self._process(so, self.runner.execute(so))
        if not outs and not failed and self.grammar_pool is not None and self._only_grammars_left():
            self.grammar_pool.wait(GRAMMAR_POLL_S)
        return failed + outs if failed else outs

    def _step_async(self) -> list[RequestOutput]:
        queued = self._queue()
        if self._in_flight is None:   # nothing to overlap with yet: queue the next batch too
            if queued is None:
                return []
            self._in_flight, queued = queued, self._queue()
        (so, pending), self._in_flight = self._in_flight, queued
        return self._process(so, pending.get_output())

    def _queue(self) -> tuple[SchedulerOutput, AsyncModelRunnerOutput] | None:
        so = self.scheduler.schedule()
        if not so.num_reqs:   # at most finished slots to hand over: no device work to queue
            if not so.is_empty:
                self.runner.execute(so)
            return None
        return so, self.runner.execute_async(so)

    def _process(self, so: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Update the scheduler and the outputs with a step's result; requests that
        finished (or were aborted) while it was in flight get nothing from it."""
        failed = [self._fail(so.requests[row], error) for row, error in result.errors.items()
                  if not so.requests[row].finished]
        if result.num_sampled is None:
            update = self.scheduler.update(so, result.tokens)
        else:
            assert result.sampled_token_ids is not None   # set with num_sampled
            update = self.scheduler.update(so, result.sampled_token_ids, result.num_sampled,
                                           result.draft_token_ids, result.num_draft_tokens)
        finished = update.finished + failed
        for rid, rows in result.prompt_logprobs.items():
            if self.outputs.parent_id(rid) is not None:
                self.outputs.add_prompt_logprobs(rid, rows)
        for req, stop, num_kept in self.outputs.process(update.advanced, result.logprobs, update.num_new):
            if not req.finished:
                finished.append(req)
            self.scheduler.stop_at(req, num_kept, stop)
        return self.outputs.outputs_for(update.advanced + failed if failed else update.advanced, finished)

    def _fail(self, req: Request, error: str) -> Request:
        """End a request whose own code failed this step; the others go on."""
        logger.warning("request %s failed: %s", req.request_id, error)
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        req.error = error
        return req


def _stop_tensor_parallel(driver: TPDriver, backend: Backend) -> None:
    """Stop the workers and give the process its share of the host back (idempotent)."""
    driver.shutdown()
    backend.leave_rank()
