"""The device-neutral sampler: logits [R, V] -> one token per row (+ logprobs).

Order (vLLM V1):
  0. the structured-output token bitmask (refused tokens -inf), before
     everything, as vLLM applies it to the logits ahead of its sampler;
  1. raw logprobs (or logits) from the unprocessed logits, if any row wants
     logprobs and the engine's `logprobs_mode` is "raw_*";
  2. logits processors: the request's own Python callables (vLLM V0's
     per-request `logits_processors`), allowed_token_ids, bad words,
     logit_bias, min_tokens, then penalties (repetition, frequency, presence);
  3. greedy rows: argmax of the processed logits (first index on ties);
  4. random rows: temperature, top-k, top-p, min-p, then argmax(probs / q)
     with q ~ Exp(1), drawn per row from the request's own generator if it
     has one;
  5. "processed_*" logprobs mode: the logprobs (or logits) of what was sampled
     from: after step 2, and for a step with random rows after step 4's
     filters (greedy rows there have temperature 1 and no filters), as vLLM 0.10.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from polyrunner.sample.grammar import apply_token_bitmask
from polyrunner.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from polyrunner.sample.metadata import SamplingMetadata
from polyrunner.sample.ops import (
    NEG_INF,
    add_logit_bias,
    apply_penalties,
    apply_top_k_top_p,
    mask_pairs,
    min_p_mask,
    random_sample,
)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor       # [R] int64
    logprobs: LogprobsTensors | None      # raw logprobs of the sampled token + top-k


def apply_request_logits_processors(logits: torch.Tensor, entries,
                                    failed: dict[int, str] | None = None) -> torch.Tensor:
    """The requests' own callables, in place on their rows of `logits` (vLLM V0 semantics:
    `fn(output_ids, row)` or `fn(prompt_ids, output_ids, row)` returns the new row).
    A callable that raises or returns something else leaves its row unprocessed and
    is reported in `failed` (row -> message); without `failed` it raises."""
    for row, fns, prompt_ids, output_ids in entries:
        values = logits[row]
        try:
            for fn, takes_prompt in fns:
                values = fn(prompt_ids, output_ids, values) if takes_prompt else fn(output_ids, values)
                if not isinstance(values, torch.Tensor) or values.shape != logits[row].shape:
                    raise TypeError(f"logits processor {fn!r} must return the logits row, a tensor of shape "
                                    f"{tuple(logits[row].shape)} (got {type(values).__name__})")
        except Exception as exc:  # noqa: BLE001 - user code: fail its request, not the step
            if failed is None:
                raise
            failed[row] = f"logits processor failed: {type(exc).__name__}: {exc}"
            continue
        logits[row] = values
    return logits


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Steps that change what greedy picks. Never writes into `logits`.

    Returns `logits` itself when nothing applies, else a processed copy.
    """
    owned = False

    def own() -> torch.Tensor:
        nonlocal logits, owned
        if not owned:
            logits, owned = logits.clone(), True
        return logits

    if meta.logits_processors:
        apply_request_logits_processors(own(), meta.logits_processors, meta.failed_rows)
    if meta.allowed_token_ids_mask is not None:
        own().masked_fill_(meta.allowed_token_ids_mask, NEG_INF)
    if meta.bad_words_rows is not None:
        mask_pairs(own(), meta.bad_words_rows, meta.bad_words_ids)
    if meta.logit_bias_rows is not None:
        add_logit_bias(own(), meta.logit_bias_rows, meta.logit_bias_ids, meta.logit_bias_values)
    if meta.min_tokens_rows is not None:
        mask_pairs(own(), meta.min_tokens_rows, meta.min_tokens_ids)
    if meta.penalty_rows is not None:
        apply_penalties(own(), meta.penalty_rows, meta.prompt_token_mask, meta.output_token_counts,
                        meta.presence_penalties, meta.frequency_penalties, meta.repetition_penalties)
    return logits


def sample(logits: torch.Tensor, meta: SamplingMetadata, return_final: bool = False,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Tokens from processed logits: greedy rows argmax, random rows sampled.

    `return_final`: also return the logits the tokens were drawn from (after
    temperature, top-k/top-p and min-p when some row is random), as (tokens, logits).
    `argmax`: replaces `logits.argmax(dim=-1)` for the greedy rows (see `Sampler`).
    """
    greedy = None
    if not meta.all_random:
        greedy = logits.argmax(dim=-1) if argmax is None else argmax(logits)
        if meta.all_greedy:
            return (greedy, logits) if return_final else greedy
    assert meta.temperature is not None
    logits = logits / meta.temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = torch.softmax(logits, dim=-1)
    if meta.min_p is not None:
        below = min_p_mask(probs, meta.min_p)
        probs.masked_fill_(below, 0.0)
        if return_final:
            logits = logits.masked_fill(below, NEG_INF)
    sampled = random_sample(probs, meta.generators, meta.default_generator)
    if greedy is not None:
        sampled = torch.where(meta.is_greedy, greedy, sampled)
    return (sampled, logits) if return_final else sampled


class Sampler:
    """Stateless; all per-request state comes in `SamplingMetadata`. `argmax`: a
    backend's faster `logits.argmax(dim=-1)` over float32 [R, V] (int64 [R], the
    first maximum, NaN counting as the maximum), used for greedy rows."""

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        if meta.grammar_bitmask is not None:
            logits = apply_token_bitmask(logits, meta.grammar_bitmask, meta.grammar_rows)
        if meta.max_num_logprobs is None:
            return SamplerOutput(sample(apply_logits_processors(logits, meta), meta, argmax=self.argmax), None)
        mode = meta.logprobs_mode
        if mode == "raw_logprobs":
            values = compute_logprobs(logits)
        elif mode == "raw_logits":
            values = logits   # the processors below never write into it
        elif mode not in ("processed_logprobs", "processed_logits"):
            raise ValueError(f"unknown logprobs_mode {mode!r}")
        processed = apply_logits_processors(logits, meta)
        if mode.startswith("processed"):
            sampled, final = sample(processed, meta, return_final=True, argmax=self.argmax)
            values = final if mode == "processed_logits" else compute_logprobs(final)
        else:
            sampled = sample(processed, meta, argmax=self.argmax)
        return SamplerOutput(sampled, gather_logprobs(values, meta.max_num_logprobs, sampled))
