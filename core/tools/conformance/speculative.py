"""Speculative decoding: with n-gram drafts the backend generates the greedy
tokens it generates without them (the verification step runs several logits
rows per request and rolls rejected positions back), with chunked prefill and
preemption forced. Static-shape backends refuse speculative decoding."""

from __future__ import annotations

from polyrunner.tools.conformance.context import generate
from polyrunner.tools.conformance.framework import MODEL_RUNS, check, expect, fail

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


@check("end_to_end", requires=("!static_shapes",), depends_on=MODEL_RUNS)
def check_speculative_decoding_same_tokens(ctx) -> str:
    """n-gram speculative decoding generates the tokens decoding without drafts generates."""
    from polyrunner.engine.llm_engine import LLMEngine
    from polyrunner.sampling_params import SamplingParams
    s = ctx.settings
    # repetitive prompts (a random piece three times): the proposer finds drafts at once
    prompts = [(p[:6] or p) * 3 for p in ctx.prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=max(32, s.max_tokens), ignore_eos=True)
    overrides = dict(num_blocks_override=s.preempt_blocks, max_num_batched_tokens=s.chunked_max_num_batched_tokens,
                     enable_prefix_caching=False)
    plain = generate(LLMEngine(ctx.make_config(**overrides)), prompts, params)
    engine = LLMEngine(ctx.make_config(speculative=SPEC, **overrides))
    got = generate(engine, prompts, params)
    for i, (g, w) in enumerate(zip(got, plain)):
        if g != w:
            at = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            fail(f"speculative decoding: prompt {i} diverges from decoding without drafts at output token {at}: "
                 f"got {g}, without drafts {w}")
    stats = engine.speculative_stats()
    expect(stats.num_accepted_tokens > 0, f"no draft token was accepted ({stats.num_draft_tokens} proposed): "
                                          "the check proved nothing")
    return (f"{len(got)} prompts equal decoding without drafts; {stats.num_accepted_tokens} of "
            f"{stats.num_draft_tokens} draft tokens accepted, {engine.scheduler.num_preemptions} preemptions")
