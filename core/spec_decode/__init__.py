"""Speculative decoding: proposers of draft tokens and acceptance statistics.

The runner asks a `Proposer` for up to `num_speculative_tokens` drafts per
request after each step; the scheduler schedules them with the request's next
token; the runner verifies them with `polyrunner.sample.rejection` and the
scheduler rolls back the rejected positions."""

from polyrunner.spec_decode.metrics import SpecDecodingStats
from polyrunner.spec_decode.ngram import NgramProposer
from polyrunner.spec_decode.proposer import Proposer, make_proposer

__all__ = ["NgramProposer", "Proposer", "SpecDecodingStats", "make_proposer"]
