"""Tensor parallelism: a backend that declares a communicator
(`Capabilities.distributed_backend`) gives with tensor_parallel_size=2 the
tokens (and, in float32, the logprobs) it gives with 1, with chunked prefill and
preemption forced."""

from __future__ import annotations

from polyrunner.tools.conformance.framework import MODEL_RUNS, check, expect, fail

LOGPROB_TOLERANCE = {"float32": 1e-4}   # other dtypes: tokens only (sums in another order round differently)


@check("distributed", requires=("distributed_backend", "devices:2"), depends_on=MODEL_RUNS)
def check_tensor_parallel_same_tokens(ctx) -> str:
    """tensor_parallel_size=2 generates the greedy tokens (and float32 logprobs) of 1."""
    from polyrunner.engine.llm_engine import LLMEngine
    from polyrunner.sampling_params import SamplingParams
    s = ctx.settings
    params = SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True, logprobs=2)
    overrides = dict(num_blocks_override=s.preempt_blocks, max_num_batched_tokens=s.chunked_max_num_batched_tokens,
                     enable_prefix_caching=False)
    results = {}
    for tp in (1, 2):
        engine = LLMEngine(ctx.make_config(tensor_parallel_size=tp, **overrides))
        try:
            results[tp] = _generate(engine, ctx.prompts(), params)
            preempted = engine.scheduler.num_preemptions
        finally:
            engine.shutdown()
    tol = LOGPROB_TOLERANCE.get(ctx.dtype_name)
    worst = 0.0
    for i, ((t1, l1), (t2, l2)) in enumerate(zip(results[1], results[2])):
        if t1 != t2:
            at = next((j for j, (a, b) in enumerate(zip(t1, t2)) if a != b), min(len(t1), len(t2)))
            fail(f"tensor_parallel_size=2: prompt {i} diverges from 1 at output token {at}: got {t2}, want {t1}")
        if tol is not None:
            worst = max([worst, *(abs(a - b) for a, b in zip(l1, l2))])
    expect(tol is None or worst <= tol, f"logprobs differ by up to {worst:.2e} (tolerance {tol})")
    return (f"{len(results[1])} prompts: the same tokens with 2 ranks as with 1"
            + (f", logprobs within {worst:.1e}" if tol is not None else "") + f" ({preempted} preemptions)")


def _generate(engine, prompts: list[list[int]], params) -> list[tuple[list[int], list[float]]]:
    """(tokens, sampled-token logprobs) per prompt, in prompt order."""
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    return [done[i] for i in ids]
