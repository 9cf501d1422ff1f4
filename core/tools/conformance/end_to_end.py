"""End to end, on the tiny random Llama: greedy tokens equal the CPU reference
backend's, token for token (in bfloat16 or float16, up to a near-tie:
`compare.excused`); seeded sampling is reproducible (across runs and
batch compositions); preemption and chunked prefill change no token;
asynchronous scheduling changes no token; speculative decoding
(`speculative.py`) and structured outputs (`structured_outputs.py`) too."""

from __future__ import annotations

from polyrunner.tools.conformance.compare import excused, first_divergence, tie_margin
from polyrunner.tools.conformance.context import generate
from polyrunner.tools.conformance.framework import MODEL_RUNS, check, expect, fail

GREEDY = "end_to_end::greedy_matches_cpu_reference"   # the same reference tokens: its failure explains theirs


def _greedy(ctx):
    from polyrunner.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=ctx.settings.max_tokens, ignore_eos=True)


def _compare(ctx, got: list[list[int]], what: str) -> str:
    """Every prompt's tokens equal the reference's, up to a near-tie the run's dtype excuses
    (`compare.excused`; float32: none), where the comparison of that prompt ends."""
    import torch
    ref, ref_logprobs = ctx.reference_tokens(), ctx.reference_logprobs()
    dtype = getattr(torch, ctx.dtype_name)
    ties = []
    for i, (g, r) in enumerate(zip(got, ref)):
        at = first_divergence(g, r)
        if at is None:
            continue
        gap = excused(at, ref_logprobs[i], dtype)
        if gap is None:
            fail(f"{what}: prompt {i} ({len(ctx.prompts()[i])} tokens) diverges from the CPU reference at "
                 f"output token {at}: got {g}, reference {r}")
        ties.append(f"prompt {i} at token {at} (top-2 gap {gap:.3f} nats < {tie_margin(dtype)})")
    excuse = f"; near-ties in {ctx.dtype_name}: {', '.join(ties)}" if ties else ""
    return f"{len(got)} prompts x {len(ref[0])} tokens equal the CPU reference{excuse}"


@check("end_to_end", depends_on=MODEL_RUNS)
def check_greedy_matches_cpu_reference(ctx) -> str:
    """Greedy generation equals the CPU reference backend token for token
    (a prefix-cache hit included)."""
    engine = ctx.engine("e2e")
    return _compare(ctx, generate(engine, ctx.prompts(), _greedy(ctx)), "greedy")


@check("end_to_end", requires=("sampling:temperature", "sampling:seed"), depends_on=MODEL_RUNS)
def check_seeded_sampling_reproducible(ctx) -> str:
    """Same seed, same tokens: across two runs, and with a different batch
    composition (alone, and among other random requests in another order)."""
    from polyrunner.sampling_params import SamplingParams
    engine = ctx.engine("e2e")
    prompts = ctx.prompts()
    n = ctx.settings.max_tokens
    seeded = [SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=n, ignore_eos=True)
              for i in range(len(prompts))]
    first = generate(engine, prompts, seeded)
    again = generate(engine, prompts, seeded)
    for i, (a, b) in enumerate(zip(first, again)):
        expect(a == b, f"seed {1000 + i}: two runs of the same batch differ: {a} vs {b}")
    alone = generate(engine, [prompts[1]], [seeded[1]])[0]
    expect(alone == first[1], f"seed 1001: alone {alone} vs in a batch {first[1]}")
    unseeded = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True)
    order = list(reversed(range(len(prompts))))
    mixed_prompts = [p for i in order for p in (prompts[i], prompts[(i + 1) % len(prompts)])]
    mixed_params = [sp for i in order for sp in (seeded[i], unseeded)]
    mixed = generate(engine, mixed_prompts, mixed_params)[::2]
    for i, got in zip(order, mixed):
        expect(got == first[i], f"seed {1000 + i}: among other requests {got} vs {first[i]}")
    distinct = len({tuple(t) for t in first})
    expect(distinct > 1 or len(first) == 1, "every seeded request sampled the same tokens: is the seed ignored?")
    return f"{len(prompts)} seeded requests reproduced in 4 batch compositions"


@check("end_to_end", depends_on=(GREEDY,))
def check_preemption_same_tokens(ctx) -> str:
    """With a KV cache too small for the batch, requests are preempted and
    recomputed, and every token still equals the reference."""
    engine = ctx.engine("preempt")
    got = generate(engine, ctx.prompts(), _greedy(ctx))
    preemptions = engine.scheduler.num_preemptions
    expect(preemptions > 0, f"no request was preempted with {ctx.settings.preempt_blocks} KV blocks: "
                            "the check proved nothing")
    return _compare(ctx, got, f"preemption ({preemptions} preemptions)")


@check("end_to_end", depends_on=(GREEDY,))
def check_chunked_prefill_same_tokens(ctx) -> str:
    """With max_num_batched_tokens below the longest prompt, prompts are
    prefilled in chunks, and every token still equals the reference."""
    engine = ctx.engine("chunked")
    budget = engine.config.scheduler.max_num_batched_tokens
    expect(max(len(p) for p in ctx.prompts()) > budget, "no prompt is longer than the token budget")
    return _compare(ctx, generate(engine, ctx.prompts(), _greedy(ctx)), f"chunked prefill (budget {budget})")


@check("end_to_end", requires=("async_scheduling",), depends_on=MODEL_RUNS)
def check_async_scheduling_same_tokens(ctx) -> str:
    """Asynchronous scheduling (step N+1 prepared while step N runs) gives the tokens
    synchronous scheduling gives, with chunked prefill, preemption, stop ids, one-token
    requests and (where the device seeds) random sampling."""
    from polyrunner.sampling_params import SamplingParams
    n = ctx.settings.max_tokens
    stop_id = ctx.reference_tokens()[1][n // 2]
    seeded = {"temperature", "seed"} <= ctx.capabilities.sampling
    params = []
    for i in range(len(ctx.prompts())):
        kind = i % 4
        if kind == 0 or (kind == 2 and not seeded):
            params.append(SamplingParams(temperature=0.0, max_tokens=n - i, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop_token_ids=[stop_id]))
        elif kind == 2:
            params.append(SamplingParams(temperature=1.0, seed=3000 + i, max_tokens=n, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i % 3, ignore_eos=True))
    asynchronous, synchronous = ctx.engine("async"), ctx.engine("sync")
    expect(asynchronous.async_scheduling, "the engine built with async_scheduling=True does not use it")
    got = generate(asynchronous, ctx.prompts(), params)
    want = generate(synchronous, ctx.prompts(), params)
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            at = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            fail(f"asynchronous scheduling: prompt {i} ({params[i].max_tokens} tokens at most) diverges from "
                 f"synchronous scheduling at output token {at}: got {g}, synchronous {w}")
    expect(len(got[1]) <= n // 2 + 1, f"stop id {stop_id} did not stop prompt 1: {got[1]}")
    preempted = asynchronous.scheduler.num_preemptions
    return (f"{len(got)} prompts equal synchronous scheduling token for token "
            f"({preempted} preemptions, budget {asynchronous.config.scheduler.max_num_batched_tokens})")


# Last, in this order: their end_to_end checks run after this module's (checks run in definition order).
# isort: off
from polyrunner.tools.conformance import structured_outputs  # noqa: E402,F401  (registers its check)
from polyrunner.tools.conformance import speculative  # noqa: E402,F401  (registers its check)
# isort: on
