"""Gemma 2 and Gemma 3 (text): greedy tokens, prefill logits and logprobs equal transformers'
(float32, tiny random models with windows and soft caps that matter), plain, with chunked
prefill and under forced preemption; the architecture read from both config formats;
Gemma's modules kept out of the Llama-contract roles; the engine's refusal of a backend
without soft-capping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrunner import LLM, SamplingParams
from test_logprobs_hf import BLOCK, PROMPTS, VARIANTS, _check_output, _params
from tiny_gemma import KINDS, build_tiny_gemma
from tiny_models import kv_bytes

MAX_NEW = 24
ENGINE_VARIANTS = {
    "default": {},
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(enable_prefix_caching=False),  # + a KV budget of 12 blocks
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    cache: dict = {}

    def make(kind: str):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            cache[kind] = (folder, build_tiny_gemma(kind, folder))
        return cache[kind]

    return make


def _prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(20, 61))).tolist() for _ in range(n)]


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(gemma, kind, variant):
    folder, hf = gemma(kind)
    prompts = _prompts()
    options = dict(ENGINE_VARIANTS[variant])
    if variant == "preempt":
        options["kv_cache_memory_bytes"] = kv_bytes(hf, 12)
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=8, block_size=16, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p, MAX_NEW), f"{kind}/{variant} prompt len {len(p)}"
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(gemma, kind):
    """Every prompt position's logits (final soft cap included) within 1e-4 relative error."""
    folder, hf = gemma(kind)
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=4)
    runner = llm.engine.runner
    captured = []
    run = runner.executor.run
    runner.executor.run = (
        lambda inputs: captured.append((run(inputs), inputs.attn.num_actual_tokens)) or captured[-1][0])
    prompts = _prompts(n=3, seed=1)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    hidden, T = captured[0]
    assert T == sum(map(len, prompts))
    ours = runner.model.compute_logits(hidden[:T])
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        rel = (ours[start:start + len(p)] - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"{kind}: relative error {rel:.2e}"
        start += len(p)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_match_transformers(gemma, kind, variant):
    """Sampled-token and prompt logprobs (top-k, ranks) within 1e-4 of transformers' log_softmax."""
    folder, hf = gemma(kind)
    kw = dict(VARIANTS[variant])
    if variant == "preempt":
        kw["kv_cache_memory_bytes"] = kv_bytes(hf, 6, BLOCK)
    llm = LLM(str(folder), backend="cpu", dtype="float32", block_size=BLOCK, max_logprobs=-1, **kw)
    params = [_params(i) for i in range(len(PROMPTS))]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    for out, sp in zip(outs, params):
        _check_output(hf, out, sp)


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
