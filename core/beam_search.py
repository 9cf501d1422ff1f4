"""Beam search results and scoring, in vLLM's shape (`vllm/beam_search.py`).

`LLM.beam_search` drives the search on top of `generate`: every step asks for
one token with `2 * beam_width` logprobs per live beam, extends each beam by
each candidate, and keeps the `beam_width` best by length-penalised score.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from polyrunner.outputs import Logprob


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` include the prompt; `text` is filled when returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """The live beams and the completed ones (ended by EOS) of one prompt."""

    def __init__(self, prompt_tokens: list[int]) -> None:
        self.beams: list[BeamSearchSequence] = [BeamSearchSequence(tokens=list(prompt_tokens))]
        self.completed: list[BeamSearchSequence] = []


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """cum_logprob / len ** length_penalty, the length counting the prompt and not a
    final EOS (HF transformers' and vLLM's score)."""
    seq_len = len(tokens)
    if tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len ** length_penalty)


def create_sort_beams_key_function(eos_token_id: int | None,
                                   length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)
    return sort_beams_key
