"""The device-neutral sampler: logits [R, V] -> one token per row (+ logprobs).

Order (vLLM V1, with the raw-logprobs mode):
  1. raw logprobs from the unprocessed logits (if any row wants logprobs);
  2. logits processors: allowed_token_ids, bad words, logit_bias, min_tokens,
     then penalties (repetition, frequency, presence);
  3. greedy rows: argmax of the processed logits (first index on ties);
  4. random rows: temperature, top-k, top-p, min-p, then argmax(probs / q)
     with q ~ Exp(1), drawn per row from the request's own generator if it
     has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrunner.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from polyrunner.sample.metadata import SamplingMetadata
from polyrunner.sample.ops import (
    NEG_INF,
    add_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    mask_pairs,
    random_sample,
)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor       # [R] int64
    logprobs: LogprobsTensors | None      # raw logprobs of the sampled token + top-k


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


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Tokens from processed logits: greedy rows argmax, random rows sampled."""
    greedy = None
    if not meta.all_random:
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy
    assert meta.temperature is not None
    logits = logits / meta.temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = torch.softmax(logits, dim=-1)
    if meta.min_p is not None:
        probs = apply_min_p(probs, meta.min_p)
    sampled = random_sample(probs, meta.generators, meta.default_generator)
    if greedy is None:
        return sampled
    return torch.where(meta.is_greedy, greedy, sampled)


class Sampler:
    """Stateless; all per-request state comes in `SamplingMetadata`."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = compute_logprobs(logits) if meta.max_num_logprobs is not None else None
        processed = apply_logits_processors(logits, meta)
        sampled = sample(processed, meta)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, meta.max_num_logprobs, sampled)
        return SamplerOutput(sampled, logprobs)
