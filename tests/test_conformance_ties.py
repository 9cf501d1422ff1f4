"""The conformance suite at a backend's own block size and dtype (core/tools/conformance).

- a backend that defaults to 64-token blocks and runs bfloat16 only is certified at 64-token
  blocks, with prompts and max_model_len scaled to them, still preempting;
- in bfloat16 a greedy divergence is excused only at a near-tie of the reference
  (`compare.excused`), never in float32, and a broken bfloat16 backend is still caught.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from polyrunner.attention.batched import sdpa_paged_attention
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.device.backend import Capabilities
from polyrunner.outputs import Logprob
from polyrunner.tools.conformance import run_conformance
from polyrunner.tools.conformance.compare import excused, first_divergence, top2_gap
from polyrunner.tools.conformance.context import ConformanceContext


def _lp(*values):
    return {i: Logprob(v, i + 1) for i, v in enumerate(values)}


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_excused_only_at_a_near_tie_in_low_precision():
    ref = [_lp(-0.1, -2.0), _lp(-0.70, -0.74)]         # a decisive position, then a near-tie
    assert top2_gap(ref[1]) == pytest.approx(0.04) and top2_gap({7: Logprob(-0.1, 1)}) == float("inf")
    assert excused(1, ref, torch.bfloat16) == pytest.approx(0.04)
    assert excused(0, ref, torch.bfloat16) is None        # a gap of 1.9 nats is no tie
    assert excused(1, ref, torch.float32) is None         # float32 compares token for token
    assert excused(2, ref, torch.bfloat16) is None        # past the reference's tokens
    assert excused(1, None, torch.bfloat16) is None


class Bf16Blocks64(CPUBackend):
    """A bfloat16-only backend whose own block size is 64 (set where the configuration leaves it)."""

    name = "bf16_blocks64"
    priority = -100
    capabilities = Capabilities(dtypes=(torch.bfloat16,))

    @classmethod
    def adjust_config(cls, config):
        if "block_size" not in config.cache.model_fields_set:
            config.cache.block_size = 64


def _wrong_scale(q, k, v, kv_cache, meta, spec):
    return sdpa_paged_attention(q, k, v, kv_cache, meta, dataclasses.replace(spec, scale=spec.scale * 3))


class BrokenBf16(Bf16Blocks64):
    """Bug: attention scores scaled 3x."""

    name = "broken_bf16_blocks64"
    attention = staticmethod(_wrong_scale)


CHECKS = ["end_to_end::greedy_matches_cpu_reference", "end_to_end::preemption_same_tokens",
          "end_to_end::chunked_prefill_same_tokens"]


def test_own_block_size_and_dtype(registered):
    name = registered(Bf16Blocks64)
    with ConformanceContext(name) as ctx:
        assert ctx.block_size == 64 and ctx.scale == 4 and ctx.dtype_name == "bfloat16"
        assert ctx.max_model_len == 512 and max(map(len, ctx.prompts())) == 48 * 4
        assert ctx.engine("e2e").config.cache.block_size == 64
    report = run_conformance(name, checks=CHECKS)
    assert report.passed, report.to_dict()   # preemption_same_tokens expects preemptions: it ran with some


def test_broken_low_precision_backend_is_caught(registered):
    name = registered(BrokenBf16)
    report = run_conformance(name, checks=CHECKS[:1])
    assert not report.passed
    assert "diverges from the CPU reference" in report.get("end_to_end::greedy_matches_cpu_reference").detail
