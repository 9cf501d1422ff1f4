"""Multi-LoRA end to end: per request, the greedy tokens of transformers on peft's merged model.

Tiny random Llama and Qwen3 base models, three adapters each made with `peft` (ranks 4 / 8 / 16;
attention only, MLP only, every linear), one batch mixing every adapter and the base model:
plain, under chunked prefill and under forced preemption, with fewer adapter slots than
adapters (the scheduler holds requests back) and with prefix caching (blocks are shared only
between requests of the same adapter).
"""

from __future__ import annotations

import pytest

from polyrunner import LLM, SamplingParams
from polyrunner.lora.request import LoRARequest
from tests.hf_oracle import assert_all_blocks_free, engine, hf_greedy, random_prompts
from tests.lora_adapters import ALL_LINEAR, ATTENTION, MLP, make_peft_adapter, merged_model
from tests.test_cpu_graphs import _bf16_graphs_reason
from tests.tiny_models import build_tiny_model, model_cache

MAX_NEW = 24
ADAPTERS = ((4, ATTENTION), (8, MLP), (16, ALL_LINEAR))   # (rank, targets) of adapters 1, 2, 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """kind -> (folder, hf, lora requests, expected tokens per prompt for each adapter id 0..3)."""
    models = model_cache(tmp_path_factory, build_tiny_model)
    cache: dict = {}

    def make(kind: str):
        if kind not in cache:
            folder, hf = models(kind)
            prompts = random_prompts(8, seed=3, min_len=5, max_len=40)
            loras, refs = [], {0: [hf_greedy(hf, p, MAX_NEW) for p in prompts]}
            for i, (rank, targets) in enumerate(ADAPTERS, start=1):
                path = make_peft_adapter(hf, tmp_path_factory.mktemp(f"{kind}-lora{i}"), rank, targets, seed=i)
                loras.append(LoRARequest(f"adapter{i}", i, path))
                merged = merged_model(hf, path)
                refs[i] = [hf_greedy(merged, p, MAX_NEW) for p in prompts]
            cache[kind] = (folder, hf, prompts, loras, refs)
        return cache[kind]
    return make


def _run(llm: LLM, prompts, loras, assign):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    requests = [None if a == 0 else loras[a - 1] for a in assign]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=requests)


SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("variant", ["default", "chunked", "preempt", "speculative", "tp2"])
def test_mixed_batch_matches_merged_models(setup, kind, variant):
    folder, hf, prompts, loras, refs = setup(kind)
    assert all(refs[i] != refs[0] for i in (1, 2, 3)), "an adapter that changes nothing proves nothing"
    extra = {"speculative": dict(speculative_config=SPECULATIVE), "tp2": dict(tensor_parallel_size=2)}.get(variant, {})
    llm = engine(folder, hf, variant if variant in ("chunked", "preempt") else "default", enable_lora=True,
                 max_loras=3, max_lora_rank=16, **extra)
    assign = [i % 4 for i in range(len(prompts))]   # base, adapter 1, 2, 3, base, ...
    outs = _run(llm, prompts, loras, assign)
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    for i, (a, out) in enumerate(zip(assign, outs)):
        assert out.outputs[0].token_ids == refs[a][i], f"{kind} {variant} prompt {i} adapter {a}"
        assert out.lora_request == (None if a == 0 else loras[a - 1])
    if variant == "speculative":
        assert llm.engine.speculative_stats().num_accepted_tokens > 0
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_fewer_slots_than_adapters(setup):
    """max_loras=2 with three adapters in the batch: the scheduler never runs more than two at
    once, adapters move through the slots, and every request still gets its adapter's tokens."""
    folder, hf, prompts, loras, refs = setup("llama")
    llm = engine(folder, hf, "default", enable_lora=True, max_loras=2, max_lora_rank=16)
    sched = llm.engine.scheduler
    most = 0
    schedule = sched.schedule

    def watched():
        nonlocal most
        out = schedule()
        most = max(most, len({r.lora_id for r in out.requests if r.lora_id}))
        return out
    sched.schedule = watched
    assign = [1, 2, 3, 0, 3, 2, 1, 0]
    outs = _run(llm, prompts, loras, assign)
    assert most == 2
    for i, (a, out) in enumerate(zip(assign, outs)):
        assert out.outputs[0].token_ids == refs[a][i], f"prompt {i} adapter {a}"


def test_prefix_cache_is_per_adapter(setup):
    """The same long prompt with adapter 1, then with adapter 2, then with adapter 1 again:
    only the third hits the cache (the second would get adapter 1's KV otherwise)."""
    folder, hf, prompts, loras, refs = setup("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=4, block_size=16, enable_lora=True,
              max_loras=2, max_lora_rank=16)
    prompt = prompts[int(max(range(len(prompts)), key=lambda i: len(prompts[i])))]
    i = prompts.index(prompt)
    stats = llm.engine.kv.pool.stats
    for a, hits in ((1, False), (2, False), (1, True)):
        before = stats.hit_tokens
        out = _run(llm, [prompt], loras, [a])[0]
        assert out.outputs[0].token_ids == refs[a][i]
        assert (stats.hit_tokens > before) == hits, f"adapter {a}"


def test_lora_errors(setup):
    folder, hf, prompts, loras, _ = setup("llama")
    plain = engine(folder, hf, "default")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate([{"prompt_token_ids": prompts[0]}], lora_request=loras[0], use_tqdm=False)
    llm = engine(folder, hf, "default", enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="greater than max_lora_rank 8"):
        llm.generate([{"prompt_token_ids": prompts[0]}], lora_request=loras[2], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_requests for 2 prompts"):
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], lora_request=[loras[0]], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, loras[0].lora_path)
    # a bad adapter in a batch fails alone; the engine and the other requests go on
    bad = LoRARequest("missing", 9, str(folder / "no-such-adapter"))
    outs = _run(llm, prompts[:2], [loras[0], bad], [1, 2])
    assert outs[0].outputs[0].token_ids and outs[1].error and "no-such-adapter" in outs[1].error
    assert llm.engine.add_lora(loras[1]) is True and llm.engine.add_lora(loras[1]) is False
    assert llm.engine.list_loras() == {1, 2}
    assert llm.engine.remove_lora(2) is True and llm.engine.remove_lora(2) is False
    assert_all_blocks_free(llm)


def test_lm_head_adapter_and_prompt_logprobs(tmp_path):
    """An adapter on every linear and the LM head (untied Llama) next to the base model: greedy
    tokens of peft's merged model, and prompt logprobs from the adapted LM head."""
    import torch

    from tests.hf_oracle import hf_logprobs
    folder, hf = tmp_path / "base", None
    hf = build_tiny_model("llama", folder)
    path = make_peft_adapter(hf, tmp_path / "head", 8, ALL_LINEAR, seed=7, with_lm_head=True)
    merged = merged_model(hf, path)
    lora = LoRARequest("head", 5, path)
    prompts = random_prompts(4, seed=5, min_len=5, max_len=30)
    llm = engine(folder, hf, "default", enable_lora=True, max_loras=1, max_lora_rank=8)
    outs = _run(llm, prompts, [lora], [1, 0, 1, 0])
    for i, out in enumerate(outs):
        want = hf_greedy(merged if i % 2 == 0 else hf, prompts[i], MAX_NEW)
        assert out.outputs[0].token_ids == want, f"prompt {i}"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False, lora_request=lora)
    want = hf_logprobs(merged, prompts[0])
    got = torch.tensor([next(iter(pos.values())).logprob for pos in out.prompt_logprobs[1:]])
    ref = want[torch.arange(len(prompts[0]) - 1), torch.tensor(prompts[0][1:])]
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


@pytest.mark.parametrize("variant", ["default", "chunked", "tp2"])
def test_embedding_adapter_matches_merged_model(tmp_path, variant):
    """An adapter on the token embeddings and the attention (untied Llama) next to the base
    model and an attention-only adapter: per request, the greedy tokens of peft's merged model."""
    folder = tmp_path / "base"
    hf = build_tiny_model("llama", folder)
    emb = make_peft_adapter(hf, tmp_path / "emb", 8, ATTENTION, seed=11, with_embed=True)
    att = make_peft_adapter(hf, tmp_path / "att", 4, ATTENTION, seed=12)
    loras = [LoRARequest("emb", 1, emb), LoRARequest("att", 2, att)]
    refs = [hf, merged_model(hf, emb), merged_model(hf, att)]
    prompts = random_prompts(6, seed=9, min_len=5, max_len=40)
    extra = dict(tensor_parallel_size=2) if variant == "tp2" else {}
    llm = engine(folder, hf, variant if variant == "chunked" else "default", enable_lora=True, max_loras=2,
                 max_lora_rank=8, **extra)
    assign = [1, 0, 2, 1, 2, 1]
    outs = _run(llm, prompts, loras, assign)
    for i, (a, out) in enumerate(zip(assign, outs)):
        assert out.outputs[0].token_ids == hf_greedy(refs[a], prompts[i], MAX_NEW), f"prompt {i} adapter {a}"
    assert hf_greedy(refs[1], prompts[0], MAX_NEW) != hf_greedy(hf, prompts[0], MAX_NEW)
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_bfloat16_cpu_graphs_give_the_eager_tokens_with_adapters(tmp_path):
    """bfloat16 decode steps replayed as CPU graphs (the adapters' kernels recorded in them, the
    embeddings' included) give the tokens and logprobs of the eager engine, per adapter."""
    folder = tmp_path / "base"
    hf = build_tiny_model("llama", folder)
    loras = [LoRARequest("emb", 1, make_peft_adapter(hf, tmp_path / "emb", 8, ALL_LINEAR, seed=13, with_embed=True)),
             LoRARequest("mlp", 2, make_peft_adapter(hf, tmp_path / "mlp", 16, MLP, seed=14))]
    prompts = random_prompts(6, seed=4, min_len=5, max_len=40)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    runs = []
    for eager in (False, True):
        llm = LLM(str(folder), backend="cpu", dtype="bfloat16", max_num_seqs=8, block_size=16, enable_lora=True,
                  max_loras=2, max_lora_rank=16, enforce_eager=eager)
        requests = [[None, *loras][i % 3] for i in range(len(prompts))]
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                 lora_request=requests))
        ex = llm.engine.runner.executor   # no small-M bf16 kernel (e.g. SIMD=0): oneDNN, no graphs
        assert (ex.num_graphs() > 0 and ex.graph_rows > 0) == (not eager and _bf16_graphs_reason() is None)
        llm.shutdown()
    for i, (g, e) in enumerate(zip(*runs)):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, f"prompt {i}"
        for a, b in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) < 1e-4
