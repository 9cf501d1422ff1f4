"""The device-neutral model runner: persistent batch -> padded inputs ->
backend execution -> sampling -> bookkeeping.

Everything here is numpy on the host and plain torch on `backend.device`; the
backend supplies padding, KV allocation, attention, graph execution and
transfers.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from polyrunner.attention.metadata import AttentionMetadata
from polyrunner.device.backend import Backend, ModelInputs
from polyrunner.config import EngineConfig
from polyrunner.runner.input_batch import InputBatch
from polyrunner.runner.inputs import StepInputs, next_decode_inputs, prepare_inputs
from polyrunner.device.kv_spec import KVCacheSpec
from polyrunner.models.arch import DecoderArch
from polyrunner.engine.request import Request
from polyrunner.sample import LogprobsLists, Sampler, SamplingState, compute_prompt_logprobs
from polyrunner.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class RunnerRequestState:
    """What the runner keeps per request across steps (and across preemption)."""

    request: Request
    generator: torch.Generator | None
    block_ids: list[int] = field(default_factory=list)
    prompt_logprobs_done: int = 0   # prompt positions whose logprobs were returned


LogprobRow = tuple[list[int], list[float], int]   # token ids, logprobs, rank of the first


@dataclass
class StepResult:
    sampled: dict[str, list[int]]                       # req_id -> new token ids (all but the decodes)
    decode_tokens: np.ndarray | None = None             # [len(so.decodes)] the decodes' tokens, in order
    logprobs: dict[str, LogprobRow] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[LogprobRow]] = field(default_factory=dict)  # this step's chunk
    num_tokens: int = 0


def dummy_step(num_tokens: int, num_reqs: int, max_blocks: int) -> StepInputs:
    """A batch of `num_reqs` requests sharing `num_tokens`, writing only the null block."""
    num_reqs = max(1, min(num_reqs, num_tokens))
    counts = np.full(num_reqs, num_tokens // num_reqs, np.int64)
    counts[num_reqs - num_tokens % num_reqs:] += num_tokens % num_reqs > 0  # longer rows last (decode-first)
    cu = np.cumsum(counts)
    arange = np.arange(num_tokens) - np.repeat(cu - counts, counts)
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


class ModelRunner:
    def __init__(self, config: EngineConfig, backend: Backend, model: torch.nn.Module,
                 arch: DecoderArch, max_model_len: int, dtype: torch.dtype) -> None:
        self.config = config
        self.backend = backend
        self.model = model
        self.arch = arch
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        self.max_blocks_per_req = -(-max_model_len // self.block_size)
        self.buckets = backend.bucket_policy(config)
        self.executor = backend.make_executor(model, config)
        self.kv_spec = KVCacheSpec(arch.num_layers, self.block_size, arch.num_kv_heads, arch.head_dim, dtype)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.sampler = Sampler()
        sched = config.scheduler
        self.batch = InputBatch(sched.max_num_seqs, max_model_len, self.max_blocks_per_req,
                                self.block_size, SamplingState(sched.max_num_seqs, arch.vocab_size, backend.device,
                                                               backend.make_generator(config.model.seed)))
        self.states: dict[str, RunnerRequestState] = {}
        self.prompt_logprob_reqs: set[str] = set()
        self._decode_rows: tuple[int, np.ndarray] | None = None   # (batch.layout_version, rows)
        # the last step, when it was an unpadded all-decode step:
        # (batch.layout_version, its host inputs, its device inputs, its sampled tokens)
        self._last_decode: tuple[int, StepInputs, ModelInputs, np.ndarray] | None = None

    # ---- start-up ---------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        """Size the KV cache from the backend's budget, allocate it, prepare graphs."""
        cache_cfg = self.config.cache
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        sched = self.config.scheduler

        def profile() -> None:
            self.kv_caches = self.backend.allocate_kv_cache(self.kv_spec, 2)
            self._run_dummy(sched.max_num_batched_tokens, sched.max_num_seqs)
            self.kv_caches = []

        if cache_cfg.num_blocks_override is not None:
            num_blocks = cache_cfg.num_blocks_override
        else:
            budget = self.backend.kv_cache_budget(self.config, weights, profile)
            num_blocks = self.backend.num_kv_blocks(self.kv_spec, budget)
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget holds {num_blocks} blocks of {self.kv_spec.page_size_bytes * self.kv_spec.num_layers} "
                "bytes; at least 2 are needed: raise kv_cache_memory_bytes")
        self.num_blocks = num_blocks
        self.kv_caches = self.backend.allocate_kv_cache(self.kv_spec, num_blocks)
        self.executor.prepare(self._run_dummy, self.buckets)
        return num_blocks

    def _run_dummy(self, num_tokens: int, num_reqs: int) -> torch.Tensor:
        num_reqs = max(1, min(num_reqs, num_tokens))
        # A request holds at most max_model_len tokens; the rest of the shape is padding.
        step = dummy_step(min(num_tokens, num_reqs * self.max_model_len), num_reqs, self.max_blocks_per_req)
        T_pad, R_pad = self.buckets.pad(num_tokens, num_reqs)
        if (T_pad, R_pad) != (step.num_tokens, step.num_reqs):
            step = _pad_dummy(step, T_pad, R_pad)
        inputs = self._to_device(step)
        with self.backend.no_grad():
            hidden = self.executor.run(inputs)
        return hidden

    # ---- one step -----------------------------------------------------------
    def execute(self, so: SchedulerOutput) -> StepResult:
        """Run one scheduled step. An all-decode step on the rows of the previous
        all-decode step advances that step's inputs (`next_decode_inputs`) instead
        of rebuilding them."""
        last, self._last_decode = self._last_decode, None
        self._update_states(so)
        batch = self.batch
        R = batch.num_reqs
        if R == 0:
            return StepResult({})
        num_scheduled = np.zeros(batch.max_num_reqs, np.int32)
        if so.others:
            index = batch.req_id_to_index
            num_scheduled[[index[s.request.request_id] for s in so.others]] = [s.num_tokens for s in so.others]
            if so.decodes:
                num_scheduled[self._rows_of(so)] = 1
            batch.reorder_decode_first(num_scheduled)
        else:
            num_scheduled[:R] = 1   # the batch holds exactly the scheduled requests
        windows = self._windows(num_scheduled[:R])
        if len(windows) > 1:
            return self._execute_split(windows, num_scheduled, so)
        T = int(num_scheduled[:R].sum()) if so.others else R
        T_pad, R_pad = self.buckets.pad(T, R)
        all_decode = not so.others and T_pad == T and R_pad == R
        step = None
        if (all_decode and so.decodes_were_scheduled and not so.decode_new_blocks
                and last is not None and last[0] == batch.layout_version):
            step = next_decode_inputs(last[1], last[3], self.block_size)  # same rows, one token on
        if step is None:
            step = prepare_inputs(batch, num_scheduled, T_pad, R_pad)
            inputs = self._to_device(step)
        else:
            inputs = self._to_device(step, last[2])
        with self.backend.no_grad():
            hidden = self.executor.run(inputs)
            out = self.executor.sample(hidden, inputs, batch, slice(0, R), step.discard, self.sampler)
            prompt_lps = self._prompt_logprobs(hidden, step, num_scheduled) if self.prompt_logprob_reqs else {}
        sampled = self.backend.to_host_async(out.sampled_token_ids).result().numpy()
        lists = None if out.logprobs is None else out.logprobs.tolists()
        result = self._bookkeeping(R, step.discard, step.num_tokens, num_scheduled, sampled, lists, so)
        result.prompt_logprobs = prompt_lps
        if all_decode:
            self._last_decode = (batch.layout_version, step, inputs, sampled[:R])
        return result

    def _rows_of(self, so: SchedulerOutput) -> np.ndarray:
        """Batch rows of `so.decodes`, in order (reused while no row moved)."""
        version = self.batch.layout_version
        cached = self._decode_rows
        if so.decodes_were_scheduled and cached is not None and cached[0] == version:
            return cached[1]
        index = self.batch.req_id_to_index
        rows = np.fromiter((index[r.request_id] for r in so.decodes), np.int64, len(so.decodes))
        self._decode_rows = (version, rows)
        return rows

    def _prompt_logprobs(self, hidden: torch.Tensor, step: StepInputs,
                         num_scheduled: np.ndarray) -> dict[str, list[LogprobRow]]:
        """Logprobs of the next prompt token at each prompt position computed this step,
        for the (few) requests that asked for prompt_logprobs."""
        out = {}
        for rid in list(self.prompt_logprob_reqs):
            state = self.states[rid]
            req, row = state.request, self.batch.req_id_to_index.get(rid)
            if row is None:
                continue
            # positions computed this step that still owe a logprob (recompute after preemption skips them)
            first = max(int(self.batch.num_computed_tokens[row]), state.prompt_logprobs_done)
            last = min(int(self.batch.num_computed_tokens[row] + num_scheduled[row]), req.num_prompt_tokens - 1)
            if last > first:
                start = int(step.query_start_loc[row]) + first - int(self.batch.num_computed_tokens[row])
                logits = self.model.compute_logits(hidden[start:start + last - first])
                targets = torch.tensor(req.prompt_token_ids[first + 1:last + 1], device=logits.device)
                lists = compute_prompt_logprobs(logits, targets, req.params.prompt_logprobs).tolists()
                out[rid] = [lists.row(i) for i in range(last - first)]
                state.prompt_logprobs_done = last
            if state.prompt_logprobs_done >= req.num_prompt_tokens - 1:
                self.prompt_logprob_reqs.discard(rid)
        return out

    # ---- split steps (static-shape backends) ------------------------------------
    def _windows(self, counts: np.ndarray) -> list[tuple[int, int]]:
        """Consecutive row windows that each fit the largest token and request bucket.

        Only a static-shape backend splits (its compiled shapes end at the largest
        bucket, which may sit below max_num_seqs, e.g. a kernel's request limit);
        other backends get the whole batch as one window.
        """
        R = len(counts)
        tb, rb = self.buckets.token_buckets, self.buckets.request_buckets
        if not self.backend.capabilities.static_shapes or not (tb or rb):
            return [(0, R)]
        max_t = tb[-1] if tb else None
        max_r = rb[-1] if rb else None
        if (max_r is None or R <= max_r) and (max_t is None or int(counts.sum()) <= max_t):
            return [(0, R)]
        windows, start, tokens = [], 0, 0
        for row, n in enumerate(counts.tolist()):
            if max_t is not None and n > max_t:
                raise ValueError(f"a request was scheduled {n} tokens, more than the largest "
                                 f"token bucket ({max_t})")
            if row > start and ((max_r is not None and row - start >= max_r)
                                or (max_t is not None and tokens + n > max_t)):
                windows.append((start, row))
                start, tokens = row, 0
            tokens += n
        windows.append((start, R))
        return windows

    def _execute_split(self, windows: list[tuple[int, int]], num_scheduled: np.ndarray,
                       so: SchedulerOutput) -> StepResult:
        """Run one step as several padded sub-batches. Each window's inputs and
        sampling rows come from its own rows of the persistent batch (the TPU
        reference runner read rows 0..n-1 for every sub-batch). Prompt logprobs
        are not computed here: no static-shape backend supports them yet."""
        if self.prompt_logprob_reqs:
            raise RuntimeError("prompt_logprobs cannot be computed in a step split into row windows; "
                               "a backend that splits steps must not declare the prompt_logprobs capability")
        batch = self.batch
        sampled, discard, lists, num_tokens = [], [], [], 0
        for start, end in windows:
            counts = num_scheduled[start:end]
            T_pad, R_pad = self.buckets.pad(int(counts.sum()), end - start)
            step = prepare_inputs(_RowWindow(batch, start, end), counts, T_pad, R_pad)
            inputs = self._to_device(step)
            with self.backend.no_grad():
                hidden = self.executor.run(inputs)
                out = self.executor.sample(hidden, inputs, batch, slice(start, end), step.discard,
                                           self.sampler)
            tokens = self.backend.to_host_async(out.sampled_token_ids).result().numpy()
            sampled.append(tokens[: end - start])
            discard.append(step.discard)
            lists.append(None if out.logprobs is None else out.logprobs.tolists())
            num_tokens += step.num_tokens
        merged = None
        if any(lp is not None for lp in lists):
            merged = LogprobsLists([], [], [])
            for (start, end), lp in zip(windows, lists):
                n = end - start
                merged.token_ids += lp.token_ids[:n] if lp else [[] for _ in range(n)]
                merged.logprobs += lp.logprobs[:n] if lp else [[] for _ in range(n)]
                merged.ranks += lp.ranks[:n] if lp else [0] * n
        return self._bookkeeping(windows[-1][1], np.concatenate(discard), num_tokens, num_scheduled,
                                 np.concatenate(sampled), merged, so)

    def _bookkeeping(self, R: int, discard: np.ndarray, num_tokens: int, num_scheduled: np.ndarray,
                     sampled: np.ndarray, lists: LogprobsLists | None, so: SchedulerOutput) -> StepResult:
        """Advance rows [0, R) of the batch by the step's sampled tokens (rows in
        `discard` computed a partial prefill and keep none) and collect the result."""
        batch = self.batch
        batch.num_computed_tokens[:R] += num_scheduled[:R]
        discard = discard[:R]
        if so.others:
            keep = np.flatnonzero(~discard)
            batch.append_tokens(keep, sampled[keep])
        else:  # all decodes: every row keeps its token
            keep = np.arange(R)
            batch.append_tokens(keep, sampled[:R])
        result = StepResult({}, num_tokens=num_tokens)
        if so.decodes:  # never discarded: a decode's one token completes its sequence
            result.decode_tokens = sampled[self._rows_of(so)].astype(np.int64)
        index = batch.req_id_to_index
        for s in so.others:
            row = index[s.request.request_id]
            if not discard[row]:
                result.sampled[s.request.request_id] = [int(sampled[row])]
        if lists is not None:
            for r in keep[batch.sampling.num_logprobs[keep] >= 0].tolist():
                rid = batch.req_ids[r]
                result.logprobs[rid] = lists.row(r, self.states[rid].request.params.logprobs)
        return result

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
            self.prompt_logprob_reqs.discard(rid)
            if rid in batch.req_id_to_index:
                batch.remove(rid)
        index = batch.req_id_to_index
        if so.decodes_were_scheduled and not so.others and batch.num_reqs == len(so.decodes):
            # the batch holds exactly the decodes already: at most new blocks
            for rid, blocks in so.decode_new_blocks.items():
                self.states[rid].block_ids.extend(blocks)
                batch.block_table.append_row(index[rid], blocks)
            batch.condense()
            return
        scheduled_reqs = so.scheduled
        scheduled = {s.request.request_id for s in scheduled_reqs}
        for rid in [r for r in batch.req_id_to_index if r not in scheduled]:
            batch.remove(rid)  # preempted or not scheduled this step: state kept
        for s in scheduled_reqs:
            req = s.request
            rid = req.request_id
            row = index.get(rid)
            if row is not None and not s.is_new:  # steady state: at most a new block
                if s.new_block_ids:
                    self.states[rid].block_ids.extend(s.new_block_ids)
                    batch.block_table.append_row(row, s.new_block_ids)
                continue
            state = self.states.get(rid)
            if state is None:
                seed = req.params.seed
                gen = self.backend.make_generator(seed) if seed is not None else None
                state = self.states[rid] = RunnerRequestState(req, gen)
                if req.params.prompt_logprobs is not None:
                    self.prompt_logprob_reqs.add(rid)
            state.block_ids = list(s.new_block_ids) if s.is_new else state.block_ids + s.new_block_ids
            if row is not None:
                batch.remove(rid)
            batch.add(rid, req.prompt_token_ids, req.output_token_ids, req.num_computed_tokens,
                      state.block_ids, dict(params=req.params, generator=state.generator,
                                            bad_words_ids=req.bad_words_token_ids,
                                            eos_token_ids=req.eos_token_ids))
        batch.condense()

    def _to_device(self, step: StepInputs, prev: ModelInputs | None = None) -> ModelInputs:
        """`step` on the device. `prev`: the device inputs of the step that `step` was
        advanced from (`next_decode_inputs`); the arrays they share are not sent again."""
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
        self.backend.build_attention_extras(meta)
        return ModelInputs(dev(step.input_ids), meta.positions, meta, self.kv_caches, logits_idx)


class _RowWindow:
    """Rows [start, end) of the persistent batch, seen by `prepare_inputs` as a
    batch of their own: every array is a view of exactly those rows."""

    def __init__(self, batch: InputBatch, start: int, end: int) -> None:
        self.num_reqs = end - start
        self.token_ids = batch.token_ids[start:end]
        self.num_tokens = batch.num_tokens[start:end]
        self.num_prompt_tokens = batch.num_prompt_tokens[start:end]
        self.num_computed_tokens = batch.num_computed_tokens[start:end]
        self.block_table = copy.copy(batch.block_table)
        self.block_table.table = batch.block_table.table[start:end]
        self.block_table.num_blocks = batch.block_table.num_blocks[start:end]


def _pad_dummy(step: StepInputs, T_pad: int, R_pad: int) -> StepInputs:
    """Pad a dummy step to a bucket with the same tail invariants as real steps."""
    T, R = step.num_tokens, step.num_reqs

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
