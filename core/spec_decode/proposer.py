"""The proposer interface: where a draft source (n-gram lookup today; EAGLE or a
small draft LM later) plugs into the runner."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from polyrunner.config import SpeculativeConfig


class Proposer(Protocol):
    """Drafts for a batch of requests, after their step's tokens were appended.

    `token_ids`: the runner's [num_slots, max_model_len] token rows (prompt then
    output); `slots`: [R] the rows to draft for; `num_tokens`: [R] valid tokens of
    each; `max_drafts`: [R] how many drafts each row may get (0: none).
    Returns (drafts [R, k] int64, num_drafts [R] int64 <= max_drafts); entries past
    a row's count are ignored. A model-based proposer would also take the step's
    hidden states; it keeps its own KV cache keyed by slot."""

    num_speculative_tokens: int

    def propose(self, token_ids: np.ndarray, slots: np.ndarray, num_tokens: np.ndarray,
                max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of `config.method`."""
    from polyrunner.spec_decode.ngram import NgramProposer
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_config.method {config.method!r} is not supported; allowed: 'ngram'")
