"""Logprobs and prompt logprobs through the engine equal `log_softmax` of
transformers' logits (float32, tiny random models, within 1e-4): the chosen
token's logprob and rank, and the top-k entries (the k largest, ranked 1..k).

The oracle is one plain HF forward over prompt + generated tokens per request.
Variants force chunked prefill (prompt logprobs arrive in pieces) and
preemption (recomputed positions must not be reported twice).
"""

import pytest

from hf_oracle import LOGPROB_BLOCK as BLOCK
from hf_oracle import LOGPROB_MAX_NEW as MAX_NEW
from hf_oracle import LOGPROB_PROMPTS as PROMPTS
from hf_oracle import LOGPROB_VARIANTS as VARIANTS
from hf_oracle import (
    assert_all_blocks_free,
    check_logprobs_match_hf,
    check_logprobs_output,
    check_position,
    hf_logprobs,
)
from polyrunner import LLM, SamplingParams


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_match_transformers(tiny_model_factory, kind, variant):
    folder, hf = tiny_model_factory(kind)
    llm, outs, params = check_logprobs_match_hf(folder, hf, variant)
    # again on the same engine (prefix cache warm): prompt logprobs still cover every position.
    # Unchunked, the second run repeats the first one's computation exactly; chunked or
    # preempted, its steps split the prompts differently (other matmul shapes, other
    # summation orders), so its logprobs match the oracle (and the first run) within TOL
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for a, b, sp in zip(outs, again, params):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if variant == "default":
            assert a.prompt_logprobs == b.prompt_logprobs and a.outputs[0].logprobs == b.outputs[0].logprobs
        else:
            check_logprobs_output(hf, b, sp)
    assert_all_blocks_free(llm)


def test_logprobs_with_n_and_without_prompt_logprobs(tiny_model_factory):
    folder, hf = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", block_size=BLOCK)
    sp = SamplingParams(n=3, temperature=1.0, seed=5, logprobs=4, max_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPTS[2]}, sp, use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    assert len(out.outputs) == 3
    for comp in out.outputs:
        lp = hf_logprobs(hf, PROMPTS[2] + comp.token_ids)
        P = len(PROMPTS[2])
        for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            check_position(entry, tok, lp[P - 1 + j], 4, f"completion {comp.index} output {j}")
    plain = llm.generate({"prompt_token_ids": PROMPTS[2]},
                         SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
