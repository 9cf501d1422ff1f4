"""Per-request sampling state, one row per request slot.

A request's row is its slot (`add_row` when it enters, `clear_row` when it
finishes); rows never move. Per-row scalars live in numpy arrays on the host;
each step `make_metadata(idx_mapping, ...)` gathers the step's rows (batch row
i is slot `idx_mapping[i]`) and uploads only what that step needs:

- scalars (temperature, top-k/p, min-p, penalties, logit-bias pairs) are
  uploaded when the rows changed since the last step, else reused;
- penalties' prompt presence and output counts are built on the device from
  the batch's token ids (one upload of the penalised rows' tokens) and only
  when some row has a penalty;
- min_tokens and bad-word masks are (row, token) pairs computed on the host
  from the current output lengths / tails;
- allowed_token_ids lives in a lazily allocated device mask [max_reqs, V];
- per-request logits processors (Python callables) get each step their row's
  prompt and output token ids from the runner's token array;
- structured outputs: a `StructuredOutputManager` (created with the first
  such request) keeps each row's grammar matcher; each step it catches up
  with the row's output tokens and fills the packed bitmask of the rows that
  have a grammar, uploaded for the sampler. A token the grammar refuses fails
  that request (`failed_rows`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from polyrunner.sample.metadata import HostSamplingRows, SamplingMetadata
from polyrunner.sampling_params import SamplingParams, logits_processor_takes_prompt

if TYPE_CHECKING:
    from polyrunner.structured.manager import StructuredOutputManager

# Per-row host scalars: (attribute, dtype, value of an empty row).
# top_k stores the vocab size for "off" (filled in __init__).
_SCALARS: tuple[tuple[str, Any, Any], ...] = (
    ("occupied", np.bool_, False),
    ("greedy", np.bool_, False),
    ("temperature", np.float32, 1.0),   # greedy rows keep 1.0 (no divide by zero)
    ("top_k", np.int64, None),          # vocab_size = off
    ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0),
    ("presence", np.float32, 0.0),
    ("frequency", np.float32, 0.0),
    ("repetition", np.float32, 1.0),
    ("has_penalty", np.bool_, False),
    ("min_tokens", np.int64, 0),
    ("num_logprobs", np.int64, -1),     # -1: none; full vocab stored as vocab_size
    ("seeded", np.bool_, False),
    ("seed", np.uint64, 0),             # the seed's 64 bits (seeds span [-2**63, 2**64))
    ("has_allowed", np.bool_, False),
    ("has_bias", np.bool_, False),
    ("has_bad_words", np.bool_, False),
    ("has_processors", np.bool_, False),
)
# Per-row Python objects. `processors`: [(fn, takes_prompt)]; `prompt_ids`: the
# prompt as a tuple, for processors that take it (built on first use).
_OBJECTS = ("params", "stop_ids", "bias", "bad_words", "processors", "prompt_ids")


@dataclass
class _Static:
    """The part of the metadata that depends only on the rows' params."""

    kwargs: dict[str, Any]
    penalty_rows: np.ndarray | None = None      # slots with a penalty
    min_tok_pair_rows: np.ndarray | None = None  # (batch row, stop id) candidates for min_tokens
    min_tok_pair_ids: np.ndarray | None = None
    bad_word_rows: list[int] = field(default_factory=list)
    processor_rows: list[int] = field(default_factory=list)


class SamplingState:
    """Sampling parameters of the running requests, one row each."""

    # per-row host scalars, [max_num_reqs] arrays set from `_SCALARS` in __init__
    occupied: np.ndarray
    greedy: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    has_penalty: np.ndarray
    min_tokens: np.ndarray
    num_logprobs: np.ndarray
    seeded: np.ndarray
    seed: np.ndarray
    has_allowed: np.ndarray
    has_bias: np.ndarray
    has_bad_words: np.ndarray
    has_processors: np.ndarray
    # per-row Python objects (None: an empty row or not set), from `_OBJECTS` in __init__
    params: list[SamplingParams | None]
    stop_ids: list[np.ndarray | None]
    bias: list[tuple[np.ndarray, np.ndarray] | None]
    bad_words: list[list[np.ndarray] | None]
    processors: list[list[tuple[Callable[..., Any], bool]] | None]
    prompt_ids: list[tuple[int, ...] | None]

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device,
                 default_generator: torch.Generator | None = None,
                 logprobs_mode: str = "raw_logprobs",
                 to_device: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`default_generator`: the engine's own stream for random rows without a
        seed, so engine-seeded runs do not depend on torch's global RNG.
        `logprobs_mode`: the engine's (see `SamplingMetadata.logprobs_mode`).
        `to_device`: the backend's upload (`Backend.to_device`: staged through pinned
        memory where the device has it); default a non-blocking `.to(device)`."""
        self.default_generator = default_generator
        self._to_device = to_device
        self.logprobs_mode = logprobs_mode
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._defaults: dict[str, Any] = {}
        for name, dtype, default in _SCALARS:
            default = vocab_size if default is None else default
            self._defaults[name] = default
            setattr(self, name, np.full(max_num_reqs, default, dtype=dtype))
        for name in _OBJECTS:
            setattr(self, name, [None] * max_num_reqs)
        self.generators: dict[int, torch.Generator] = {}
        self._allowed_mask: torch.Tensor | None = None  # [max_reqs, V] bool, True = masked
        self._version = 0
        self._static_key: tuple[int, int] | None = None
        self._static: _Static | None = None
        self.structured: StructuredOutputManager | None = None   # with the first structured request

    # ---- row management (called by the runner's RequestStates) ------------
    def add_row(self, row: int, params: SamplingParams, generator: torch.Generator | None,
                bad_words_ids: list[list[int]] | None = None, *,
                eos_token_ids: frozenset[int] = frozenset()) -> None:
        """Put a request into `row` (the row's previous content is dropped).

        generator: the request's own generator (for seeded requests), created
          on this device by the backend; kept across preemption by the caller.
          A seeded random request without one gets a fresh generator here.
        bad_words_ids: `params.bad_words_token_ids(tokenizer)`.
        eos_token_ids: the model's EOS ids; masked, with stop_token_ids, until
          min_tokens output tokens exist (even with ignore_eos).
        """
        self._check_row(row)
        vocab = self.vocab_size
        params.validate_for_vocab(vocab)
        for seq in bad_words_ids or []:
            if not seq or not all(0 <= t < vocab for t in seq):
                raise ValueError(f"bad_words_ids must be non-empty sequences of ids in [0, {vocab}) (got {seq!r})")
        stop_ids = np.array(sorted(set(params.stop_token_ids) | set(eos_token_ids)), dtype=np.int64)
        if stop_ids.size and not (0 <= stop_ids.min() and stop_ids.max() < vocab):
            raise ValueError(f"eos_token_ids must be in [0, {vocab}) (got {sorted(eos_token_ids)!r})")

        self._reset(row)
        greedy = params.is_greedy
        self.occupied[row] = True
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else params.temperature
        if not greedy:   # a greedy row keeps no filter (vLLM resets them), so its processed logprobs have none
            self.top_k[row] = params.top_k if 0 < params.top_k < vocab else vocab
            self.top_p[row] = params.top_p
            self.min_p[row] = params.min_p
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.has_penalty[row] = params.has_penalties
        self.min_tokens[row] = params.min_tokens
        if params.seed is not None:
            self.seeded[row] = True
            self.seed[row] = params.seed & 0xFFFFFFFFFFFFFFFF
        if params.min_tokens > 0 and stop_ids.size:
            self.stop_ids[row] = stop_ids
        if params.logprobs is not None:
            self.num_logprobs[row] = vocab if params.logprobs < 0 else min(params.logprobs, vocab)
        if params.logit_bias:
            ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
            vals = np.fromiter(params.logit_bias.values(), dtype=np.float32)
            self.bias[row] = (ids, vals)
            self.has_bias[row] = True
        if bad_words_ids:
            self.bad_words[row] = [np.asarray(seq, dtype=np.int64) for seq in bad_words_ids]
            self.has_bad_words[row] = True
        if params.logits_processors:
            self.processors[row] = [(fn, logits_processor_takes_prompt(fn)) for fn in params.logits_processors]
            self.has_processors[row] = True
        if params.allowed_token_ids is not None:
            mask = self._allowed()
            mask[row] = True
            ids = torch.as_tensor(params.allowed_token_ids, dtype=torch.long).to(self.device)
            mask[row, ids] = False
            self.has_allowed[row] = True
        if params.structured_outputs is not None:
            if self.structured is None:
                from polyrunner.structured.manager import StructuredOutputManager
                self.structured = StructuredOutputManager(self.max_num_reqs, vocab)
            self.structured.add(row, params.structured_outputs)
        self.params[row] = params
        if generator is None and params.seed is not None and not greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        if generator is not None:
            self.generators[row] = generator
        self._version += 1

    def clear_row(self, row: int) -> None:
        self._check_row(row)
        self._reset(row)
        self._version += 1

    def _reset(self, row: int) -> None:
        if self.has_allowed[row]:
            self._allowed_mask[row] = False
        for name, _, _ in _SCALARS:
            getattr(self, name)[row] = self._defaults[name]
        for name in _OBJECTS:
            getattr(self, name)[row] = None
        self.generators.pop(row, None)
        if self.structured is not None:
            self.structured.remove(row)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise IndexError(f"row {row} out of range [0, {self.max_num_reqs})")

    def _allowed(self) -> torch.Tensor:
        if self._allowed_mask is None:
            self._allowed_mask = torch.zeros(self.max_num_reqs, self.vocab_size,
                                             dtype=torch.bool, device=self.device)
        return self._allowed_mask

    # ---- per step -------------------------------------------------------
    def _upload(self, arr: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor that owns its memory (host rows keep changing)."""
        t = torch.from_numpy(np.array(arr, copy=True))
        if self.device.type == "cpu":
            return t
        return self._to_device(t) if self._to_device is not None else t.to(self.device, non_blocking=True)

    def generators_by_row(self, slots: np.ndarray, discard: np.ndarray | None = None
                          ) -> dict[int, torch.Generator]:
        """Batch row -> its own generator, for the seeded random rows of a step whose row i
        is slot `slots[i]` (rows in `discard` draw nothing)."""
        gens: dict[int, torch.Generator] = {}
        if self.generators:   # loop over the (few) seeded requests, not over the batch
            row_of = np.full(self.max_num_reqs, -1, np.int64)
            row_of[slots] = np.arange(len(slots))
            for slot, g in self.generators.items():
                i = int(row_of[slot])
                if i >= 0 and not self.greedy[slot] and (discard is None or not discard[i]):
                    gens[i] = g
        return gens

    def make_metadata(self, idx_mapping: np.ndarray, token_ids: np.ndarray,
                      num_prompt_tokens: np.ndarray, num_tokens: np.ndarray,
                      discard: np.ndarray | None = None) -> SamplingMetadata:
        """Metadata for one step whose batch row i is slot `idx_mapping[i]`.

        token_ids: [max_reqs, max_model_len] int32, row = slot, prompt then
          output tokens, valid up to num_tokens[slot] (before this step's sample).
        num_prompt_tokens, num_tokens: int arrays indexed by slot.
        discard: bool [R], batch rows whose sample is thrown away (partial
          prefills); they do not draw from their generator. None = none.
        """
        slots = np.asarray(idx_mapping, dtype=np.int64)
        n = len(slots)
        key = (self._version, slots.tobytes())
        if self._static_key != key:
            self._static, self._static_key = self._build_static(slots), key
        static = self._static

        gens = self.generators_by_row(slots, discard) if not static.kwargs["all_greedy"] else {}
        meta = SamplingMetadata(num_reqs=n, generators=gens, default_generator=self.default_generator,
                                host_rows=functools.partial(self._host_rows, slots, num_prompt_tokens,
                                                            num_tokens),
                                logprobs_mode=self.logprobs_mode, **static.kwargs)

        if static.penalty_rows is not None:
            self._penalty_counts(meta, static.penalty_rows, token_ids, num_prompt_tokens, num_tokens)
        if static.min_tok_pair_rows is not None:
            rows = static.min_tok_pair_rows  # batch rows
            pair_slots = slots[rows]
            num_out = np.asarray(num_tokens, dtype=np.int64)[pair_slots] - num_prompt_tokens[pair_slots]
            sel = num_out < self.min_tokens[pair_slots]
            if sel.any():
                meta.min_tokens_rows = self._upload(rows[sel])
                meta.min_tokens_ids = self._upload(static.min_tok_pair_ids[sel])
        if static.processor_rows:
            self._processor_rows(meta, static.processor_rows, slots, token_ids, num_prompt_tokens,
                                 num_tokens, discard)
        if static.bad_word_rows:
            self._bad_word_pairs(meta, static.bad_word_rows, slots, token_ids, num_prompt_tokens,
                                 num_tokens)
        if self.structured is not None and self.structured.matchers:
            self._grammar_bitmask(meta, slots, token_ids, num_prompt_tokens, num_tokens)
        return meta

    def _grammar_bitmask(self, meta: SamplingMetadata, slots: np.ndarray, token_ids: np.ndarray,
                         num_prompt_tokens: np.ndarray, num_tokens: np.ndarray) -> None:
        """Advance the step's grammars to their rows' outputs, then the bitmask of the
        rows that have one (all rows: no `grammar_rows`)."""
        errors = self.structured.sync(slots, token_ids, num_prompt_tokens, num_tokens)
        if errors:
            for row in np.flatnonzero(np.isin(slots, list(errors))).tolist():
                meta.failed_rows[row] = errors[int(slots[row])]
        bitmask, rows = self.structured.fill_bitmask(slots)
        if not rows.size:
            return
        if rows.size == len(slots):
            meta.grammar_bitmask = self._upload(bitmask.numpy())
        else:
            meta.grammar_bitmask = self._upload(bitmask.numpy()[rows])
            meta.grammar_rows = self._upload(rows)

    def _host_rows(self, slots: np.ndarray, num_prompt_tokens: np.ndarray,
                   num_tokens: np.ndarray) -> HostSamplingRows:
        return HostSamplingRows(
            greedy=self.greedy[slots], temperature=self.temperature[slots], top_k=self.top_k[slots],
            top_p=self.top_p[slots], min_p=self.min_p[slots], seeded=self.seeded[slots], seed=self.seed[slots],
            num_output_tokens=num_tokens[slots].astype(np.int64) - num_prompt_tokens[slots],
            min_tokens=self.min_tokens[slots], stop_ids=[self.stop_ids[s] for s in slots.tolist()],
            num_logprobs=self.num_logprobs[slots])

    def _build_static(self, slots: np.ndarray) -> _Static:
        vocab = self.vocab_size
        greedy = self.greedy[slots]
        all_greedy = bool(greedy.all()) if len(slots) else True
        all_random = not bool(greedy.any())
        random_rows = ~greedy
        kw: dict[str, Any] = dict(all_greedy=all_greedy, all_random=all_random)
        if not all_greedy:
            kw["temperature"] = self._upload(self.temperature[slots])
            if not all_random:
                kw["is_greedy"] = self._upload(greedy)
            top_k, top_p, min_p = self.top_k[slots], self.top_p[slots], self.min_p[slots]
            if (random_rows & (top_k < vocab)).any():
                kw["top_k"] = self._upload(top_k)
            if (random_rows & (top_p < 1.0)).any():
                kw["top_p"] = self._upload(top_p)
            if (random_rows & (min_p > 0.0)).any():
                kw["min_p"] = self._upload(min_p)
        num_logprobs = self.num_logprobs[slots]
        kw["num_logprobs"] = num_logprobs
        if (num_logprobs >= 0).any():
            kw["max_num_logprobs"] = int(num_logprobs.max())
        if self.has_allowed[slots].any():
            kw["allowed_token_ids_mask"] = self._allowed_mask[torch.from_numpy(slots).to(self.device)]
        bias_rows = np.flatnonzero(self.has_bias[slots])
        if bias_rows.size:
            pairs = [self.bias[s] for s in slots[bias_rows].tolist()]
            kw["logit_bias_rows"] = self._upload(np.repeat(bias_rows, [len(p[0]) for p in pairs]))
            kw["logit_bias_ids"] = self._upload(np.concatenate([p[0] for p in pairs]))
            kw["logit_bias_values"] = self._upload(np.concatenate([p[1] for p in pairs]))
        static = _Static(kw)
        pen_rows = np.flatnonzero(self.has_penalty[slots])
        if pen_rows.size:
            pen_slots = slots[pen_rows]
            static.penalty_rows = pen_slots
            kw["penalty_rows"] = self._upload(pen_rows)
            kw["presence_penalties"] = self._upload(self.presence[pen_slots])
            kw["frequency_penalties"] = self._upload(self.frequency[pen_slots])
            kw["repetition_penalties"] = self._upload(self.repetition[pen_slots])
        mt_rows = [i for i in np.flatnonzero(self.min_tokens[slots] > 0).tolist()
                   if self.stop_ids[slots[i]] is not None]
        if mt_rows:
            static.min_tok_pair_rows = np.repeat(np.array(mt_rows, dtype=np.int64),
                                                 [len(self.stop_ids[slots[i]]) for i in mt_rows])
            static.min_tok_pair_ids = np.concatenate([self.stop_ids[slots[i]] for i in mt_rows])
        static.bad_word_rows = np.flatnonzero(self.has_bad_words[slots]).tolist()
        static.processor_rows = np.flatnonzero(self.has_processors[slots]).tolist()
        return static

    def _penalty_counts(self, meta: SamplingMetadata, rows: np.ndarray, token_ids: np.ndarray,
                        num_prompt_tokens: np.ndarray, num_tokens: np.ndarray) -> None:
        """Prompt presence and output counts of the penalised rows, on the device."""
        vocab = self.vocab_size
        n_prompt = np.asarray(num_prompt_tokens, dtype=np.int64)[rows]
        n_tok = np.asarray(num_tokens, dtype=np.int64)[rows]
        length = max(int(n_tok.max()), 1)
        ids = self._upload(token_ids[rows, :length]).long()   # [Rp, L]
        n_prompt_t = self._upload(n_prompt).unsqueeze(1)
        n_tok_t = self._upload(n_tok).unsqueeze(1)
        pos = torch.arange(length, device=ids.device).unsqueeze(0)
        valid = (ids >= 0) & (ids < vocab)   # async placeholders (-1) count for nothing
        in_prompt = valid & (pos < n_prompt_t)
        in_output = valid & (pos >= n_prompt_t) & (pos < n_tok_t)
        sink = torch.full_like(ids, vocab)   # column V collects everything that does not count
        prompt_mask = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=ids.device)
        prompt_mask.scatter_(1, torch.where(in_prompt, ids, sink), True)
        counts = torch.zeros(len(rows), vocab + 1, dtype=torch.int32, device=ids.device)
        counts.scatter_add_(1, torch.where(in_output, ids, sink),
                            torch.ones(ids.shape, dtype=torch.int32, device=ids.device))
        meta.prompt_token_mask = prompt_mask[:, :vocab]
        meta.output_token_counts = counts[:, :vocab]

    def _processor_rows(self, meta: SamplingMetadata, rows: list[int], slots: np.ndarray,
                        token_ids: np.ndarray, num_prompt_tokens: np.ndarray, num_tokens: np.ndarray,
                        discard: np.ndarray | None) -> None:
        """The rows whose request has logits processors, with its prompt and output ids
        (rows whose sample is discarded, partial prefills, call nothing)."""
        entries = []
        for i in rows:
            if discard is not None and discard[i]:
                continue
            s = int(slots[i])
            n_prompt, n_tok = int(num_prompt_tokens[s]), int(num_tokens[s])
            prompt = self.prompt_ids[s]
            if prompt is None:
                prompt = self.prompt_ids[s] = tuple(token_ids[s, :n_prompt].tolist())
            entries.append((i, self.processors[s], prompt, token_ids[s, n_prompt:n_tok].tolist()))
        if entries:
            meta.logits_processors = entries

    def _bad_word_pairs(self, meta: SamplingMetadata, rows: list[int], slots: np.ndarray,
                        token_ids: np.ndarray, num_prompt_tokens: np.ndarray,
                        num_tokens: np.ndarray) -> None:
        """(row, token) pairs blocked by bad words: a word's last token is blocked
        when its other tokens equal the tail of the generated output."""
        pair_rows: list[int] = []
        pair_ids: list[int] = []
        for i in rows:
            s = int(slots[i])
            n_tok = int(num_tokens[s])
            n_out = n_tok - int(num_prompt_tokens[s])
            for word in self.bad_words[s]:
                prefix = len(word) - 1
                if prefix > n_out:
                    continue
                if prefix == 0 or np.array_equal(token_ids[s, n_tok - prefix:n_tok], word[:-1]):
                    pair_rows.append(i)
                    pair_ids.append(int(word[-1]))
        if pair_rows:
            meta.bad_words_rows = self._upload(np.array(pair_rows, dtype=np.int64))
            meta.bad_words_ids = self._upload(np.array(pair_ids, dtype=np.int64))
