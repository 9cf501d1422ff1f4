"""Tensor parallelism: a backend that declares a communicator
(`Capabilities.distributed_backend`) gives with tensor_parallel_size=2 the
tokens (and, in float32, the logprobs) it gives with 1, with chunked prefill and
preemption forced; in bfloat16 or float16 up to a near-tie of rank 1's (`compare.excused`)."""

from __future__ import annotations

from polyrunner.tools.conformance.compare import excused, first_divergence
from polyrunner.tools.conformance.context import generate_outputs
from polyrunner.tools.conformance.framework import MODEL_RUNS, check, expect, fail

LOGPROB_TOLERANCE = {"float32": 1e-4}   # other dtypes: tokens only (sums in another order round differently)


@check("distributed", requires=("distributed_backend", "devices:2"), depends_on=MODEL_RUNS)
def check_tensor_parallel_same_tokens(ctx) -> str:
    """tensor_parallel_size=2 generates the greedy tokens (and float32 logprobs) of 1."""
    import torch

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
            results[tp] = generate_outputs(engine, ctx.prompts(), params)
            preempted = engine.scheduler.num_preemptions
        finally:
            engine.shutdown()
    tol = LOGPROB_TOLERANCE.get(ctx.dtype_name)
    dtype = getattr(torch, ctx.dtype_name)
    worst, ties = 0.0, []
    for i, (one, two) in enumerate(zip(results[1], results[2])):
        t1, t2 = list(one.token_ids), list(two.token_ids)
        at = first_divergence(t2, t1)
        if at is not None:
            gap = excused(at, one.logprobs, dtype)
            if gap is None:
                fail(f"tensor_parallel_size=2: prompt {i} diverges from 1 at output token {at}: got {t2}, want {t1}")
            ties.append(f"prompt {i} at token {at} (top-2 gap {gap:.3f} nats)")
        elif tol is not None:
            worst = max([worst, *(abs(_sampled(one, j) - _sampled(two, j)) for j in range(len(t1)))])
    expect(tol is None or worst <= tol, f"logprobs differ by up to {worst:.2e} (tolerance {tol})")
    return (f"{len(results[1])} prompts: the same tokens with 2 ranks as with 1"
            + (f", logprobs within {worst:.1e}" if tol is not None else "")
            + (f"; near-ties in {ctx.dtype_name}: {', '.join(ties)}" if ties else "") + f" ({preempted} preemptions)")


def _sampled(output, j: int) -> float:
    """The logprob of output token j of a `CompletionOutput`."""
    return float(output.logprobs[j][output.token_ids[j]].logprob)
