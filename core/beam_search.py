"""Beam search in vLLM's shape (`vllm/beam_search.py`, `LLM.beam_search`).

`beam_search` drives the search on top of a `generate` function: every step asks
for one token with `2 * beam_width` logprobs per live beam, extends each beam by
each candidate, and keeps the `beam_width` best by length-penalised score.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from tqdm.auto import tqdm

from polyrunner.outputs import Logprob, RequestOutput
from polyrunner.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


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


def beam_search(generate: Callable[[list[Any], SamplingParams, bool], list[RequestOutput]],
                prompts: list[Any], params: BeamSearchParams, eos: int | None, max_model_len: int,
                tokenizer: Any, use_tqdm: bool = False, concurrency_limit: int | None = None
                ) -> list[BeamSearchOutput]:
    """`generate(prompts, params, first)` runs one step for the given prompts (`first`:
    every prompt invalid raises). A candidate that is EOS (unless `ignore_eos`)
    completes its beam; a beam at `max_model_len` is complete ("length"). `tokens`
    include the prompt and `text` decodes them all, as vLLM's.
    `concurrency_limit` (vLLM's): search at most that many prompts at once, chunk by
    chunk in prompt order (None: all at once); the results are the same."""
    if concurrency_limit is not None and (isinstance(concurrency_limit, bool)
                                          or not isinstance(concurrency_limit, int) or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be an integer >= 1 or None, got {concurrency_limit!r}")
    if use_tqdm and concurrency_limit is not None:
        logger.warning("Progress bar is not supported when using concurrency_limit. Disabling progress bar.")
        use_tqdm = False
    chunk = concurrency_limit or max(len(prompts), 1)
    chunks = [prompts[i:i + chunk] for i in range(0, len(prompts), chunk)] or [prompts]
    instances: list[BeamSearchInstance] = []
    first_errors: list[str | None] = []
    for part in chunks:
        # one chunk: every prompt invalid raises as generate does; several: only when all are
        found, errors = _search(generate, part, params, eos, max_model_len, use_tqdm, len(chunks) == 1)
        instances += found
        first_errors += errors
    if len(chunks) > 1 and first_errors and all(e is not None for e in first_errors):
        raise ValueError(first_errors[0])
    sort_key = create_sort_beams_key_function(eos, params.length_penalty)
    outputs = []
    for inst in instances:
        best = sorted(inst.completed + inst.beams, key=sort_key, reverse=True)[:params.beam_width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=False) if tokenizer is not None else None
        outputs.append(BeamSearchOutput(best))
    return outputs


def _search(generate: Callable[[list[Any], SamplingParams, bool], list[RequestOutput]], prompts: list[Any],
            params: BeamSearchParams, eos: int | None, limit: int, use_tqdm: bool, first_raises: bool
            ) -> tuple[list[BeamSearchInstance], list[str | None]]:
    """Run the search for `prompts` to the end; returns their instances and each
    prompt's rejection error (None: accepted)."""
    width, ignore_eos = params.beam_width, params.ignore_eos
    sort_key = create_sort_beams_key_function(eos, params.length_penalty)
    step_params = SamplingParams(logprobs=2 * width, max_tokens=1, temperature=params.temperature)
    # the first step runs the prompts as given
    results = generate(prompts, step_params, first_raises)
    errors = [out.error for out in results]
    instances = [BeamSearchInstance(out.prompt_token_ids) for out in results]
    beams = [(inst, inst.beams[0]) for inst in instances]
    steps = range(params.max_tokens)
    if use_tqdm:
        steps = tqdm(steps, desc="Beam search", unit="token")
    for step in steps:
        if step > 0:
            for inst in instances:   # a beam at max_model_len cannot grow: it is complete
                full = [beam for beam in inst.beams if len(beam.tokens) >= limit]
                if full:
                    for beam in full:
                        beam.finish_reason = "length"
                    inst.completed += full
                    inst.beams = [beam for beam in inst.beams if len(beam.tokens) < limit]
            beams = [(inst, beam) for inst in instances for beam in inst.beams]
            if not beams:
                break
            results = generate([{"prompt_token_ids": beam.tokens} for _, beam in beams], step_params, False)
        fresh: dict[int, list[BeamSearchSequence]] = {id(inst): [] for inst in instances}
        for (inst, beam), result in zip(beams, results):
            candidates = result.outputs[0].logprobs
            if not candidates:   # its prompt was rejected
                continue
            position = candidates[0]
            for token, lp in position.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [position],
                                         beam.cum_logprob + lp.logprob)
                if token == eos and not ignore_eos:
                    inst.completed.append(new)
                else:
                    fresh[id(inst)].append(new)
        for inst in instances:
            inst.beams = sorted(fresh[id(inst)], key=sort_key, reverse=True)[:width]
    return instances, errors
