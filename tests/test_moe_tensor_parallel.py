"""Tensor parallelism on a mixture of experts (CPU backend, gloo): each rank holds its slice of
every expert's intermediate rows (and of the shared expert's and the dense layers'), the router
is whole on each; tensor_parallel_size=2 gives the greedy tokens of 1, logprobs within 1e-4
(Mixtral; Qwen2-MoE with a shared expert and a dense layer)."""

import pytest

from moe_tiny_models import build_moe_model
from polyrunner import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 200, 31, 7], [1, 44, 3, 8] * 9, [1, 300, 301, 302, 17, 99, 23, 5, 6, 7, 8], [1, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)


def _run(folder, tp: int):
    llm = LLM(str(folder), backend="cpu", dtype="float32", tensor_parallel_size=tp, max_num_seqs=8,
              max_num_batched_tokens=16)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_tp2_equals_tp1(kind, tmp_path):
    build_moe_model(kind, tmp_path)
    expected, got = _run(tmp_path, 1), _run(tmp_path, 2)
    for g, e in zip(got, expected):
        go, eo = g.outputs[0], e.outputs[0]
        assert go.token_ids == eo.token_ids
        for gp, ep in zip(go.logprobs, eo.logprobs):
            assert gp.keys() == ep.keys()
            for tid in ep:
                assert abs(gp[tid].logprob - ep[tid].logprob) < 1e-4
