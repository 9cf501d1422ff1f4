"""Greedy output and prefill logits equal Hugging Face transformers (float32)."""

import pytest

from conftest import KINDS
from hf_oracle import ENGINE_VARIANTS, check_greedy_matches_hf, check_prefill_logits_match_hf, random_prompts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(tiny_model_factory, kind, variant):
    folder, hf = tiny_model_factory(kind)
    check_greedy_matches_hf(folder, hf, variant, random_prompts(), 12, label=f"{kind}/", finish_length=True)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(tiny_model_factory, kind):
    """Every prompt position's logits equal transformers' within 1e-4 relative error."""
    folder, hf = tiny_model_factory(kind)
    check_prefill_logits_match_hf(folder, hf, random_prompts(n=3, seed=1), label=f"{kind}: ")
