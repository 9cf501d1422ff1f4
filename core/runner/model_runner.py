"""The device-neutral model runner: scheduler output -> slot-indexed state ->
padded inputs -> backend execution -> core sampling -> sampled tokens.

Everything here is numpy on the host and plain torch on `backend.device`; the
backend supplies padding, KV allocation, attention, graph execution and
transfers, and may supply its own sampling function (`GraphExecutor.sample`).

A step runs as named stages, each holding its variations (asynchronous
scheduling, draft tokens) inside: `_update_states` (finished slots out, new
requests in, block deltas) -> `_prepare_inputs` -> `executor.run` -> `_logits`
-> `_sample` -> the output stage. `execute` runs a step and waits for its
tokens (`_output`); `execute_async` queues one and returns at once
(`_queue_output`, an `AsyncModelRunnerOutput`): the next step, prepared while
this one runs, reads this one's tokens on the device. Logprobs and prompt
logprobs come back like the tokens: copied with `backend.to_host_async` when the
step is queued, read when its output is.

Speculative decoding (`config.speculative`): after each step the proposer drafts
tokens for the rows that may take them; a step that schedules drafts computes
logits at every draft position and verifies them with the rejection sampler
(`_sample_drafts`). Rows whose sampling depends on the tokens before each
position in ways the batch metadata cannot express per position (penalties,
bad words, logits processors, min_tokens not reached) or that report logprobs
get no drafts, so every token is drawn from exactly the normal sampler's
distribution; structured-output rows get drafts, masked per position by their
grammar.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from polyrunner.attention.metadata import AttentionMetadata
from polyrunner.config import EngineConfig
from polyrunner.device.backend import Backend, GraphExecutor, ModelInputs, model_compute_logits
from polyrunner.device.kv_spec import KVCacheSpec
from polyrunner.distributed.logits import GatherLogits
from polyrunner.lora.manager import LoRAManager
from polyrunner.models.arch import DecoderArch
from polyrunner.numeric import cdiv, cumsum_and_arange
from polyrunner.runner.async_output import PLACEHOLDER, AsyncModelRunnerOutput
from polyrunner.runner.inputs import (
    StepInputs,
    dummy_step,
    next_decode_inputs,
    pad_dummy,
    prepare_inputs,
)
from polyrunner.runner.states import RequestStates
from polyrunner.sample import (
    LogprobsFuture,
    LogprobsTensors,
    SamplingMetadata,
    SamplingState,
    compute_prompt_logprobs,
)
from polyrunner.sample.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from polyrunner.spec_decode.proposer import Proposer, make_proposer
from polyrunner.step_channel import LogprobRow, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LastDecode:
    """The last step, when it was an unpadded all-decode step."""

    slots: np.ndarray
    step: StepInputs
    inputs: ModelInputs
    tokens: np.ndarray | None   # its sampled tokens; None while they are on the device


@dataclass(slots=True)
class Sampled:
    """The sample stage's result. `token_ids`: one token per row on the device; with
    drafts instead `spec_tokens` [R, k + 1] on the host (accepted drafts, then the
    sampled token) and `num_sampled` [R]. `errors`: batch row -> why its own code failed."""

    token_ids: torch.Tensor | None
    errors: dict[int, str]
    logprobs: LogprobsTensors | None
    logprob_rows: list[tuple[int, str, int]]   # (batch row, request id, logprobs asked)
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    spec_tokens: np.ndarray | None = None
    num_sampled: np.ndarray | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, backend: Backend, model: torch.nn.Module,
                 arch: DecoderArch, max_model_len: int, dtype: torch.dtype,
                 gather_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`arch`: this rank's heads (tensor parallelism) and the whole vocabulary;
        `gather_vocab`: joins the ranks' vocabulary ranges of a logits tensor (a
        tensor-parallel rank; None: the model's logits are whole)."""
        self.config = config
        self.backend = backend
        self.model = model
        self.arch = arch
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.max_blocks_per_req = cdiv(max_model_len, self.block_size)
        backend.executor = backend.make_executor(model)   # the backend's own, read by its later members
        self.executor: GraphExecutor | GatherLogits = backend.executor
        self.buckets = backend.bucket_policy()   # after the executor: it may depend on what that made
        self.gather_vocab = gather_vocab
        if gather_vocab is not None:
            self.executor = GatherLogits(self.executor, gather_vocab)
        self.kv_spec = KVCacheSpec(arch.num_layers, self.block_size, arch.num_kv_heads, arch.head_dim, dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        num_slots = config.scheduler.max_num_seqs
        sampling = SamplingState(num_slots, arch.vocab_size, backend.device,
                                 backend.make_generator(config.model.seed), config.model.logprobs_mode,
                                 backend.to_device)
        self.states = RequestStates(num_slots, max_model_len, self.max_blocks_per_req, self.block_size, sampling)
        self._last_decode: LastDecode | None = None   # the next all-decode step on its slots advances it
        self._in_flight: AsyncModelRunnerOutput | None = None   # the last step `execute_async` queued
        self._decode_ready = False   # the last step is an unpadded all-decode step
        spec = config.speculative
        self.proposer: Proposer | None = make_proposer(spec) if spec is not None else None
        self.lora: LoRAManager | None = None   # `attach_lora`, with LoRA enabled

    @property
    def max_step_tokens(self) -> int:
        """The most tokens (padded) a step or a start-up run gives the model."""
        sched = self.config.scheduler
        return max(self.buckets.pad(sched.max_num_batched_tokens, sched.max_num_seqs)[0],
                   sched.max_num_batched_tokens)

    def attach_lora(self, manager: LoRAManager) -> None:
        """Serve adapters through `manager` (made on this runner's model before `initialize_kv_cache`)."""
        self.lora = manager

    # ---- start-up ---------------------------------------------------------
    def initialize_kv_cache(self, agree: Callable[[int], int] | None = None) -> int:
        """Size the KV cache from the backend's budget, allocate it, prepare graphs.
        `agree(num_blocks)`: the number every tensor-parallel rank can hold (their minimum)."""
        cache_cfg = self.config.cache
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        sched = self.config.scheduler

        def profile(worst_case: bool = False) -> None:
            self.kv_caches = self.backend.allocate_kv_cache(self.kv_spec, 2)
            self._run_dummy(sched.max_num_batched_tokens, sched.max_num_seqs)
            if worst_case:
                self._profile_worst_steps()
            self.kv_caches = []

        if cache_cfg.num_blocks_override is not None:
            num_blocks = cache_cfg.num_blocks_override
        else:
            budget = self.backend.kv_cache_budget(weights, profile)
            num_blocks = self.backend.num_kv_blocks(self.kv_spec, budget)
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget holds {num_blocks} blocks of "
                f"{self.kv_spec.page_size_bytes * self.kv_spec.num_layers} "
                "bytes; at least 2 are needed: raise kv_cache_memory_bytes")
        if agree is not None:
            num_blocks = agree(num_blocks)
        self.num_blocks = num_blocks
        self.kv_caches = self.backend.allocate_kv_cache(self.kv_spec, num_blocks)
        spec = self.kv_spec
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)", num_blocks, spec.block_size,
                    num_blocks * spec.block_size, num_blocks * spec.page_size_bytes * spec.num_layers / 2**30)
        self.executor.prepare(self._run_dummy, self.buckets)
        return num_blocks

    def _run_dummy(self, num_tokens: int, num_reqs: int) -> torch.Tensor:
        num_reqs = max(1, min(num_reqs, num_tokens))
        # A request holds at most max_model_len tokens; the rest of the shape is padding.
        step = dummy_step(min(num_tokens, num_reqs * self.max_model_len), num_reqs, self.max_blocks_per_req)
        T_pad, R_pad = self.buckets.pad(num_tokens, num_reqs)
        if (T_pad, R_pad) != (step.num_tokens, step.num_reqs):
            step = pad_dummy(step, T_pad, R_pad)
        inputs = self._to_device(step)
        with self.backend.no_grad():
            hidden = self.executor.run(inputs)
        return hidden

    def _profile_worst_steps(self) -> None:
        """For a backend's memory profile (`profile(worst_case=True)`): the longest
        prefill (one request's largest chunk at the end of a max_model_len context,
        its tokens writing the null block) and sampling max_num_seqs rows with
        top-k/top-p/logprobs. Leaves no sampling state behind."""
        from polyrunner.sampling_params import SamplingParams
        sched, n = self.config.scheduler, self.config.scheduler.max_num_seqs
        chunk = min(sched.max_num_batched_tokens, self.max_model_len)
        step = dummy_step(chunk, 1, self.max_blocks_per_req)
        step.positions += self.max_model_len - chunk
        step.seq_lens[:] = step.max_seq_len = self.max_model_len
        T_pad, R_pad = self.buckets.pad(chunk, 1)
        if (T_pad, R_pad) != (chunk, 1):
            step = pad_dummy(step, T_pad, R_pad)
        inputs = self._to_device(step)
        sampling, slots = self.states.sampling, np.arange(n)
        max_lp = self.config.model.max_logprobs
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=max_lp if max_lp >= 0 else 20)
        with self.backend.no_grad():
            hidden = self.executor.run(inputs)
            rows = hidden[int(step.logits_indices[0])].expand(n, -1).contiguous()
            logits = self.executor.compute_logits(rows, inputs, n)
            for slot in slots.tolist():
                sampling.add_row(slot, params, None)
            try:
                ones = np.ones(n, np.int32)
                self.executor.sample(logits, sampling.make_metadata(slots, self.states.token_ids, ones, ones))
            finally:
                for slot in slots.tolist():
                    sampling.clear_row(slot)

    # ---- per-request state ----------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """The step's changes to the slots, in order: drop the finished requests (and their
        rows of a step still in flight), add the new ones (maybe into those very slots),
        apply the block-id deltas."""
        states = self.states
        if so.finished_slots:
            for slot in so.finished_slots:
                states.remove(slot)
            self._last_decode = None
            if self._in_flight is not None:
                self._in_flight.drop_slots(so.finished_slots)
        if so.removed_loras and self.lora is not None:
            for lora_id in so.removed_loras:
                self.lora.remove(lora_id)
        for new in so.new_requests:
            seed = new.params.seed
            states.add(new, self.backend.make_generator(seed) if seed is not None else None)
            if new.lora_request is not None and self.lora is not None:
                self.lora.register(new.lora_request)
        states.apply(so)

    # ---- one step: update states -> prepare inputs -> run -> logits -> sample -> output
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and wait for its tokens. A step without rows only
        drops its finished slots."""
        if not so.num_reqs:
            self._update_states(so)
            return ModelRunnerOutput(np.zeros(0, np.int64))
        step, inputs, sampled = self._forward(so, None)
        return self._output(so, step, inputs, sampled)

    def execute_async(self, so: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Queue one scheduled step (with rows); its tokens arrive later (`get_output()`).
        The step in flight before it must be the previous one: its tokens feed this step's
        inputs on the device and are written into the token rows before this step samples."""
        prev = self._in_flight
        step, inputs, sampled = self._forward(so, prev)
        return self._queue_output(so, step, inputs, sampled)

    def _forward(self, so: SchedulerOutput, prev: AsyncModelRunnerOutput | None
                 ) -> tuple[StepInputs, ModelInputs, Sampled]:
        """The stages up to the sampled tokens (still on the device, except with drafts)."""
        self._update_states(so)
        step, inputs = self._prepare_inputs(so, prev)
        with self.backend.no_grad():
            hidden = self.executor.run(inputs)
            logits = self._logits(so, hidden, inputs)
            if prev is not None:
                prev.resolve()   # waits for the previous step only; this one is queued behind it
            sampled = self._sample(so, step, logits)
            if self.states.prompt_logprobs_done:
                sampled.prompt_logprobs = self._prompt_logprobs(hidden, step, so)
        return step, inputs, sampled

    def _logits(self, so: SchedulerOutput, hidden: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        """Logits of each row's last token, or (drafts) of each row's last token and drafts."""
        if so.num_draft_tokens is None:
            return self.executor.compute_logits(hidden, inputs, so.num_reqs)
        num_virtual = int(so.num_draft_tokens.sum()) + so.num_reqs
        return self.executor.compute_logits(hidden, inputs, num_virtual)[:num_virtual]

    def _sample(self, so: SchedulerOutput, step: StepInputs, logits: torch.Tensor) -> Sampled:
        """One token per row (`executor.sample`), or with drafts the rejection sampler's."""
        states = self.states
        if so.num_draft_tokens is not None:
            return self._sample_drafts(so, step, logits)
        meta = states.sampling.make_metadata(so.slots, states.token_ids, states.num_prompt_tokens,
                                             states.num_tokens, step.discard)
        out = self.executor.sample(logits, meta)
        return Sampled(out.sampled_token_ids, meta.failed_rows, out.logprobs,
                       self._logprob_rows(so, step, meta) if out.logprobs is not None else [])

    def _sample_drafts(self, so: SchedulerOutput, step: StepInputs, logits: torch.Tensor) -> Sampled:
        """Row i's last token and its `so.num_draft_tokens[i]` drafts each have logits (a
        "virtual row" with the row's sampling parameters); the rejection sampler keeps the
        accepted drafts and one more token. A step with a row that reports logprobs
        samples only each row's first position (drafts rejected)."""
        states, sampling = self.states, self.states.sampling
        num_drafts, draft_ids = so.num_draft_tokens, so.draft_token_ids
        assert num_drafts is not None and draft_ids is not None
        counts = num_drafts.astype(np.int64) + 1
        meta = sampling.make_metadata(np.repeat(so.slots, counts), states.token_ids, states.num_prompt_tokens,
                                      states.num_tokens, np.repeat(step.discard, counts))
        self._draft_bitmask(meta, so)
        if meta.max_num_logprobs is None:
            own = sampling.generators_by_row(so.slots, step.discard)
            tokens, num_sampled = rejection_sample(logits, meta, draft_ids, num_drafts, own,
                                                   sampling.default_generator)
            row_of_virtual = np.repeat(np.arange(so.num_reqs), counts)
            errors = {int(row_of_virtual[v]): msg for v, msg in meta.failed_rows.items()}
            return Sampled(None, errors, None, [], spec_tokens=tokens, num_sampled=num_sampled)
        # logprobs are reported per sampled token by the normal sampler
        first = torch.from_numpy(np.cumsum(counts) - counts).to(logits.device)
        meta = sampling.make_metadata(so.slots, states.token_ids, states.num_prompt_tokens,
                                      states.num_tokens, step.discard)
        out = self.executor.sample(logits[first], meta)
        R = so.num_reqs
        tokens = np.full((R, draft_ids.shape[1] + 1), PLACEHOLDER_TOKEN_ID, np.int64)
        tokens[:, 0] = self.backend.to_host_async(out.sampled_token_ids).result().numpy()[:R]
        rows = self._logprob_rows(so, step, meta) if out.logprobs is not None else []
        return Sampled(None, meta.failed_rows, out.logprobs, rows, spec_tokens=tokens,
                       num_sampled=np.ones(R, np.int64))

    def _output(self, so: SchedulerOutput, step: StepInputs, inputs: ModelInputs,
                sampled: Sampled) -> ModelRunnerOutput:
        """Synchronous output stage: wait for the tokens, append them to the rows whose
        sample counts, build the step's output; propose the next drafts."""
        states, R = self.states, so.num_reqs
        kept = np.flatnonzero(~step.discard) if step.discard.any() else None
        logprobs, prompt_lps = self._logprobs_to_host(sampled)
        if sampled.spec_tokens is None:
            assert sampled.token_ids is not None
            tokens = self.backend.to_host_async(sampled.token_ids).result().numpy()[:R].astype(np.int64, copy=False)
            states.append(so.slots if kept is None else so.slots[kept], tokens if kept is None else tokens[kept])
            spec_tokens, num_sampled = (tokens[:, None], np.ones(R, np.int64)) if self.proposer else (None, None)
        else:
            spec_tokens, num_sampled = sampled.spec_tokens, sampled.num_sampled
            assert num_sampled is not None
            keep = np.arange(R) if kept is None else kept
            states.append_tokens(so.slots[keep], spec_tokens[keep], num_sampled[keep])
            tokens = spec_tokens[:, 0].copy()
        result = ModelRunnerOutput(tokens, prompt_logprobs=host_rows(prompt_lps), errors=sampled.errors,
                                   sampled_token_ids=spec_tokens, num_sampled=num_sampled)
        if logprobs is not None:
            lists = logprobs.result()
            for r, req_id, k in sampled.logprob_rows:
                result.logprobs[req_id] = lists.row(r, k)
        if self._decode_ready:
            self._last_decode = LastDecode(so.slots, step, inputs, tokens)
        if self.proposer is not None:
            self._propose(so, step, result)
        return result

    def _queue_output(self, so: SchedulerOutput, step: StepInputs, inputs: ModelInputs,
                      sampled: Sampled) -> AsyncModelRunnerOutput:
        """Asynchronous output stage: start the tokens' copy to the host, hold their places
        in the token rows with placeholders, return the step in flight."""
        assert sampled.token_ids is not None   # no drafts with asynchronous scheduling
        states = self.states
        kept = np.flatnonzero(~step.discard)
        kept_slots = so.slots[kept]
        positions = states.num_tokens[kept_slots].astype(np.int64)
        states.append(kept_slots, PLACEHOLDER)
        future = self.backend.to_host_async(sampled.token_ids)
        logprobs, prompt_lps = self._logprobs_to_host(sampled)
        errors = sampled.errors
        self._in_flight = AsyncModelRunnerOutput(
            future, sampled.token_ids, so.slots, kept, positions, states.num_slots, states.token_ids,
            lambda tokens: ModelRunnerOutput(tokens, prompt_logprobs=host_rows(prompt_lps), errors=errors),
            logprobs, sampled.logprob_rows)
        if self._decode_ready:
            self._last_decode = LastDecode(so.slots, step, inputs, None)
        return self._in_flight

    def _draft_bitmask(self, meta: SamplingMetadata, so: SchedulerOutput) -> None:
        """Structured outputs: each virtual row's mask is the grammar's after the row's
        drafts before it (`StructuredOutputManager.fill_bitmask` with the drafts; the
        metadata's matchers were synced to the kept tokens). A draft the grammar
        refuses has probability 0 there, so it is rejected."""
        structured = self.states.sampling.structured
        if structured is None or not structured.matchers:
            return
        draft_ids, num_drafts = so.draft_token_ids, so.num_draft_tokens
        assert draft_ids is not None and num_drafts is not None
        drafts = [row[:n] for row, n in zip(draft_ids.tolist(), num_drafts.tolist())]
        bitmask, rows = structured.fill_bitmask(so.slots, drafts)
        meta.grammar_bitmask = meta.grammar_rows = None
        if rows.size:
            meta.grammar_bitmask = torch.from_numpy(bitmask.numpy()[rows]).to(self.backend.device)
            meta.grammar_rows = torch.from_numpy(rows).to(self.backend.device)

    def _propose(self, so: SchedulerOutput, step: StepInputs, result: ModelRunnerOutput) -> None:
        """Drafts for each row's next step (rows that may take them, see the module
        docstring), into `result`."""
        states, sampling = self.states, self.states.sampling
        slots = so.slots
        num_tokens = states.num_tokens[slots].astype(np.int64)
        may = ~(sampling.has_penalty | sampling.has_bad_words | sampling.has_processors
                | (sampling.num_logprobs >= 0))[slots]
        may &= num_tokens - states.num_prompt_tokens[slots] >= sampling.min_tokens[slots]
        may &= ~step.discard
        if ((sampling.num_logprobs >= 0) & sampling.occupied).any():
            may[:] = False   # a verification step with a logprobs row would drop every draft
        assert self.proposer is not None
        k = self.proposer.num_speculative_tokens
        result.draft_token_ids, result.num_draft_tokens = self.proposer.propose(
            states.token_ids, slots, num_tokens, np.where(may, k, 0))

    def _prepare_inputs(self, so: SchedulerOutput, prev: AsyncModelRunnerOutput | None
                        ) -> tuple[StepInputs, ModelInputs]:
        """The step's inputs on the device (tokens still on the device come from `prev`, the
        step in flight; drafts are written after each row's tokens and give logits rows).
        An unpadded all-decode step on the slots of the previous one advances that step's
        inputs (`next_decode_inputs`) instead of rebuilding them. Sets `_decode_ready`:
        the next step may advance this one's inputs."""
        states = self.states
        if so.num_draft_tokens is not None:
            assert so.draft_token_ids is not None
            states.write_drafts(so.slots, so.draft_token_ids, so.num_draft_tokens)
        last, self._last_decode = self._last_decode, None
        R, T = so.num_reqs, so.total_num_tokens
        T_pad, R_pad = self.buckets.pad(T, R)
        all_decode = T == R and T_pad == T and R_pad == R
        step = None
        if (all_decode and last is not None and not so.new_block_ids
                and (last.slots is so.slots or np.array_equal(last.slots, so.slots))):
            on_device = last.tokens is None   # the host ids stay placeholders: the tokens are on the device
            sampled = last.tokens if last.tokens is not None else np.full(R, PLACEHOLDER, np.int64)
            step = next_decode_inputs(last.step, sampled, self.block_size)
            if step is not None:
                fed = None
                if on_device:
                    assert prev is not None
                    fed = prev.sampled[:R].to(torch.int64)
                inputs = self._to_device(step, last.inputs, fed)
        if step is None:
            step = prepare_inputs(states, so, T_pad, R_pad)
            write = None if prev is None else prev.feed_input_ids(
                step.input_ids, step.num_tokens, step.token_to_req, so.slots, self.backend.to_device)
            inputs = self._to_device(step)
            if write is not None:
                write(inputs.input_ids)
        logits_indices = step.logits_indices
        if so.num_draft_tokens is not None:   # logits at each row's last token and at its drafts
            counts = so.num_draft_tokens.astype(np.int64) + 1
            ends = step.query_start_loc[1:R + 1].astype(np.int64)
            logits_indices = np.repeat(ends - counts, counts) + cumsum_and_arange(counts)[1]
            inputs.logits_indices = self.backend.to_device(logits_indices)
        if self.lora is not None:
            self.lora.prepare_step(states.lora_id[so.slots], step.token_to_req, step.num_tokens, logits_indices)
        # a one-token prefill chunk looks like a decode, but its sample is discarded:
        # the next step's input is the prompt's next token, not that sample
        self._decode_ready = all_decode and not step.discard.any()
        return step, inputs

    def _logprob_rows(self, so: SchedulerOutput, step: StepInputs,
                      meta: SamplingMetadata) -> list[tuple[int, str, int]]:
        """(batch row, request id, logprobs asked) of the rows that report sampled logprobs."""
        states = self.states
        assert meta.num_logprobs is not None
        rows = np.flatnonzero((meta.num_logprobs >= 0) & ~step.discard)
        out = []
        for r in rows.tolist():
            slot = int(so.slots[r])
            req_id, params = states.req_ids[slot], states.sampling.params[slot]
            assert req_id is not None and params is not None and params.logprobs is not None
            out.append((r, req_id, int(params.logprobs)))
        return out

    def _logprobs_to_host(self, sampled: Sampled) -> tuple[LogprobsFuture | None, dict[str, LogprobsFuture]]:
        """Start the copies to the host of the step's logprobs (None: no row reports any) and
        prompt logprobs (by request id), without waiting for them."""
        copy = self.backend.to_host_async
        logprobs = None if sampled.logprobs is None else sampled.logprobs.to_host_async(copy)
        return logprobs, {req_id: lps.to_host_async(copy) for req_id, lps in sampled.prompt_logprobs.items()}

    def _prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs,
                         so: SchedulerOutput) -> dict[str, LogprobsTensors]:
        """Logprobs of the next prompt token at each prompt position computed this step,
        on the device, for the (few) requests that asked for prompt_logprobs."""
        out: dict[str, LogprobsTensors] = {}
        states = self.states
        for slot, done in list(states.prompt_logprobs_done.items()):
            rows = np.flatnonzero(so.slots == slot)
            if not rows.size:
                continue
            row = int(rows[0])
            computed = int(so.num_computed[row])
            num_prompt = int(states.num_prompt_tokens[slot])
            # positions computed this step that still owe a logprob (recompute after preemption skips them)
            first = max(computed, done)
            last = min(computed + int(so.num_scheduled[row]), num_prompt - 1)
            if last > first:
                start = int(step.query_start_loc[row]) + first - computed
                if self.lora is not None:
                    self.lora.prepare_logits(int(states.lora_id[slot]), last - first)
                logits = model_compute_logits(self.model)(hidden[start:start + last - first])
                if self.gather_vocab is not None:
                    logits = self.gather_vocab(logits)
                targets = self.backend.to_device(states.token_ids[slot, first + 1:last + 1].astype(np.int64))
                req_id, params = states.req_ids[slot], states.sampling.params[slot]
                assert req_id is not None and params is not None and params.prompt_logprobs is not None
                k = params.prompt_logprobs
                out[req_id] = compute_prompt_logprobs(logits, targets, k)
                done = states.prompt_logprobs_done[slot] = last
            if done >= num_prompt - 1:
                del states.prompt_logprobs_done[slot]
        return out

    def _to_device(self, step: StepInputs, prev: ModelInputs | None = None,
                   input_ids: torch.Tensor | None = None) -> ModelInputs:
        """`step` on the device. `prev`: the device inputs of the step that `step` was
        advanced from (`next_decode_inputs`); the arrays they share are not sent again.
        `input_ids`: the token ids already on the device (the previous step's samples)."""
        dev = self.backend.to_device
        if prev is None:
            qsl, tables = dev(step.query_start_loc), dev(step.block_tables)
            tok_req, logits_idx = dev(step.token_to_req), dev(step.logits_indices)
        else:
            qsl, tables, tok_req = prev.attn.query_start_loc, prev.attn.block_tables, prev.attn.token_to_req
            logits_idx = prev.logits_indices
        meta = AttentionMetadata(
            num_actual_tokens=step.num_tokens, num_reqs=step.num_reqs, num_decodes=step.num_decodes,
            max_query_len=step.max_query_len, max_seq_len=step.max_seq_len,
            query_start_loc=qsl, seq_lens=dev(step.seq_lens),
            block_tables=tables, slot_mapping=dev(step.slot_mapping),
            positions=dev(step.positions), token_to_req=tok_req,
            query_start_loc_np=step.query_start_loc, seq_lens_np=step.seq_lens)
        for key, array in self.backend.host_attention_extras(step).items():
            meta.extras[key] = dev(array)
        ids = dev(step.input_ids) if input_ids is None else input_ids
        return ModelInputs(ids, meta.positions, meta, self.kv_caches, logits_idx)


def host_rows(pending: dict[str, LogprobsFuture]) -> dict[str, list[LogprobRow]]:
    """Prompt logprobs on the host: wait for each request's copies, one row per position."""
    return {req_id: future.result().rows() for req_id, future in pending.items()}
