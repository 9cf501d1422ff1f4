"""Verify draft tokens against the target model: the rejection sampler.

A request with d drafts contributes d + 1 consecutive rows of logits ("virtual
rows"): row j scores the token after draft j - 1 (row 0: after its last real
token). Every row is processed exactly as the normal sampler would (logits
processors, allowed ids, bias, penalties, then temperature, top-k, top-p,
min-p), so the distribution each position is drawn from is the target's. A
structured-output bitmask in the metadata is applied first (virtual row j: the
grammar's state after the drafts before j).

- greedy rows accept while the draft equals the argmax; the token after the
  accepted prefix is the argmax there;
- random rows (the draft distribution q is one-hot: drafts come from an n-gram
  lookup) accept draft j with probability p_j(draft); at the first rejection the
  token is drawn from the residual normalize(max(p_j - q_j, 0)), which is p_j
  with the draft zeroed; when all d are accepted a bonus token is drawn from
  p_d. Each position's token is then distributed exactly as p.

Seeded requests draw their uniforms and noise from their own generator.
Outputs: [R, k + 1] tokens (accepted drafts, then one sampled token; -1 after),
and the count per row (accepted + 1).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from polyrunner.numeric import cumsum_and_arange
from polyrunner.sample.grammar import apply_token_bitmask
from polyrunner.sample.metadata import SamplingMetadata
from polyrunner.sample.ops import apply_top_k_top_p, min_p_mask
from polyrunner.sample.sampler import apply_logits_processors

PLACEHOLDER_TOKEN_ID = -1   # vLLM's padding of the per-row token lists


def target_probs(processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Normalised probabilities the normal sampler draws random rows from."""
    logits = processed / meta.temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = torch.softmax(logits, dim=-1)
    if meta.min_p is not None:
        probs.masked_fill_(min_p_mask(probs, meta.min_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, draft_ids: np.ndarray,
                     num_drafts: np.ndarray, generators: dict[int, torch.Generator] | None = None,
                     default_generator: torch.Generator | None = None,
                     argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of R requests from their virtual rows.

    logits: [R_v, V], R_v = sum(num_drafts + 1), request r's rows consecutive;
    meta: the sampling metadata of those R_v rows (each row its request's slot);
    draft_ids: [R, k] int64, row r's first num_drafts[r] entries are its drafts;
    generators: request row r -> its generator (seeded random requests);
    argmax: a backend's faster `argmax(dim=-1)`.
    Returns (tokens [R, k + 1] int64, PLACEHOLDER_TOKEN_ID-padded; num_sampled [R]).
    """
    R = len(num_drafts)
    k = draft_ids.shape[1] if draft_ids.ndim == 2 else 0
    counts = num_drafts.astype(np.int64) + 1
    row_of = np.repeat(np.arange(R), counts)                     # virtual row -> request row
    cu, pos = cumsum_and_arange(counts)                          # pos: its position j
    is_draft = pos < counts[row_of] - 1
    draft_v = np.where(is_draft, draft_ids[row_of, np.minimum(pos, max(k - 1, 0))] if k else -1, -1)
    dev = logits.device
    draft_t = torch.from_numpy(np.maximum(draft_v, 0)).to(dev)
    has_draft = torch.from_numpy(is_draft).to(dev)

    logits = logits.float()
    if meta.grammar_bitmask is not None:   # per position: the grammar's state after the drafts before it
        logits = apply_token_bitmask(logits, meta.grammar_bitmask, meta.grammar_rows)
    processed = apply_logits_processors(logits, meta)
    target = None
    accept = torch.zeros(len(row_of), dtype=torch.bool, device=dev)
    if not meta.all_random:
        target = processed.argmax(dim=-1) if argmax is None else argmax(processed)
        accept = has_draft & (target == draft_t)
    if not meta.all_greedy:
        probs = target_probs(processed, meta)
        q = torch.empty_like(probs)
        u = torch.empty(len(row_of), dtype=probs.dtype, device=dev)
        gens = generators or {}
        if len(gens) != R:
            q.exponential_(generator=default_generator)
            u.uniform_(generator=default_generator)
        for r, gen in gens.items():   # the (few) seeded requests: their own streams
            lo, hi = int(cu[r] - counts[r]), int(cu[r])
            q[lo:hi].exponential_(generator=gen)
            u[lo:hi].uniform_(generator=gen)
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        p_draft = probs.gather(1, draft_t.unsqueeze(1)).squeeze(1)
        residual = probs.scatter(1, draft_t.unsqueeze(1), 0.0)    # p with the draft zeroed
        residual = torch.where(has_draft.unsqueeze(1) & (residual.sum(-1, keepdim=True) > 0), residual, probs)
        sampled = residual.div(q).argmax(dim=-1)
        accept_random = has_draft & (u < p_draft)
        if meta.is_greedy is None:   # all random
            target, accept = sampled, accept_random
        else:
            target = torch.where(meta.is_greedy, target, sampled)
            accept = torch.where(meta.is_greedy, accept, accept_random)

    target_np = target.cpu().numpy().astype(np.int64)
    acc = np.zeros((R, k + 1), bool)
    acc[row_of, pos] = accept.cpu().numpy()
    num_accepted = np.cumprod(acc, axis=1).sum(axis=1)          # leading accepted drafts
    tokens = np.full((R, k + 1), PLACEHOLDER_TOKEN_ID, np.int64)
    keep = pos <= num_accepted[row_of]
    tokens[row_of[keep], pos[keep]] = np.where(pos < num_accepted[row_of], draft_v, target_np)[keep]
    return tokens, num_accepted + 1
