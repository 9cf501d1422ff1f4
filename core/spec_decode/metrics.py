"""Speculative decoding counters (vLLM's SpecDecodingStats names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodingStats:
    """Totals since the engine started. A "draft" is one verification of a
    request's proposed tokens in one step."""

    num_drafts: int = 0              # (request, step) pairs verified with >= 1 draft token
    num_draft_tokens: int = 0        # draft tokens verified
    num_accepted_tokens: int = 0     # draft tokens accepted

    def observe(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += num_drafts
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields per request on average: 1 + accepted drafts
        (vLLM's "mean acceptance length"); 1.0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
