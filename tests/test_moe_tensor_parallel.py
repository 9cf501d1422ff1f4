"""Tensor parallelism on a mixture of experts (CPU backend, gloo): each rank holds its slice of
every expert's intermediate rows (and of the shared expert's and the dense layers'), the router
is whole on each; tensor_parallel_size=2 gives the greedy tokens of 1, logprobs within 1e-4
(Mixtral; Qwen2-MoE with a shared expert and a dense layer), with chunked prefill."""

import pytest

from moe_tiny_models import build_moe_model
from test_tensor_parallel import _assert_same, _run


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_tp2_equals_tp1(kind, tmp_path):
    build_moe_model(kind, tmp_path)
    _assert_same(_run(tmp_path, 2, max_num_batched_tokens=16), _run(tmp_path, 1, max_num_batched_tokens=16))
