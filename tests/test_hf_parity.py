"""Greedy output and prefill logits equal Hugging Face transformers (float32)."""

import numpy as np
import pytest
import torch

from conftest import KINDS
from polyrunner import LLM, SamplingParams
from tiny_models import kv_bytes


def _prompts(n: int = 8, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(3, 60))).tolist() for _ in range(n)]


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()



ENGINE_VARIANTS = {
    "default": {},
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(enable_prefix_caching=False),  # + a KV budget of 12 blocks
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_transformers(tiny_model_factory, kind, variant):
    folder, hf = tiny_model_factory(kind)
    prompts = _prompts()
    max_new = 12
    options = dict(ENGINE_VARIANTS[variant])
    if variant == "preempt":
        options["kv_cache_memory_bytes"] = kv_bytes(hf, 12)
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=8, block_size=16, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True), use_tqdm=False)
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p, max_new), f"{kind}/{variant} prompt len {len(p)}"
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(tiny_model_factory, kind):
    """Every prompt position's logits equal transformers' within 1e-4 relative error."""
    folder, hf = tiny_model_factory(kind)
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=4)
    runner = llm.engine.runner
    captured = []
    run = runner.executor.run
    runner.executor.run = (
        lambda inputs: captured.append((run(inputs), inputs.attn.num_actual_tokens)) or captured[-1][0])
    prompts = _prompts(n=3, seed=1)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    hidden, T = captured[0]  # one prefill step holds all three prompts
    assert T == sum(map(len, prompts))
    ours = runner.model.compute_logits(hidden[:T])
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        got = ours[start:start + len(p)]
        rel = (got - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"{kind}: relative error {rel:.2e}"
        start += len(p)
