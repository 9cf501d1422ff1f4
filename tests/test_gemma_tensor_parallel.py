"""Gemma 2 and Gemma 3 under tensor parallelism (CPU, gloo): tensor_parallel_size=2 gives the
greedy tokens of 1, logprobs within 1e-4. Gemma's extra norms sit after the all-reduces
(post-attention, post-feed-forward), its soft caps and windows are per head: a wrong split
of any of them shows as different tokens."""

import pytest

from test_tensor_parallel import _assert_same, _run
from tiny_gemma import KINDS, build_tiny_gemma


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_equals_tp1(kind, tmp_path):
    build_tiny_gemma(kind, tmp_path)
    _assert_same(_run(tmp_path, 2), _run(tmp_path, 1))
