"""Logprobs and prompt logprobs through the engine equal `log_softmax` of
transformers' logits (float32, tiny random models, within 1e-4): the chosen
token's logprob and rank, and the top-k entries (the k largest, ranked 1..k).

The oracle is one plain HF forward over prompt + generated tokens per request.
Variants force chunked prefill (prompt logprobs arrive in pieces) and
preemption (recomputed positions must not be reported twice).
"""

import math

import numpy as np
import pytest
import torch

from polyrunner import LLM, SamplingParams
from tiny_models import kv_bytes

TOL = 1e-4
BLOCK = 16
MAX_NEW = 6


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 512, size=k).tolist() for k in (5, 23, 40, 57)]


PROMPTS = _prompts()
# (logprobs, prompt_logprobs, temperature): top-k, none, full vocabulary, greedy
REQUESTS = [(5, 5, 0.8), (0, 0, 0.8), (-1, 3, 0.0), (2, -1, 1.0)]


def _params(i: int) -> SamplingParams:
    lp, plp, temp = REQUESTS[i % len(REQUESTS)]
    return SamplingParams(temperature=temp, seed=70 + i, logprobs=lp, prompt_logprobs=plp,
                          max_tokens=MAX_NEW, ignore_eos=True)



def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_position(entry, token: int, lp_row: torch.Tensor, k: int, where: str) -> None:
    """One position's entry against the oracle's logprob row."""
    vocab = lp_row.shape[0]
    k = vocab if k < 0 else k
    assert token in entry, f"{where}: the actual token is missing"
    chosen = entry[token]
    want = float(lp_row[token])
    assert abs(chosen.logprob - want) <= TOL, f"{where}: logprob {chosen.logprob} vs HF {want}"
    rank_lo = 1 + int((lp_row > want + TOL).sum())
    rank_hi = 1 + int((lp_row > want - TOL).sum())
    assert rank_lo <= chosen.rank <= rank_hi, f"{where}: rank {chosen.rank}, HF says {rank_lo}..{rank_hi}"
    top = {tid: e for tid, e in entry.items() if not (tid == token and e.rank > k)}
    assert len(top) == k, f"{where}: {len(top)} top entries, wanted {k}"
    assert len(entry) in (k, k + 1)
    if k == 0:
        return
    assert sorted(e.rank for tid, e in top.items() if tid != token) == \
        sorted(set(range(1, k + 1)) - ({chosen.rank} if token in top else set()))
    kth = float(torch.topk(lp_row, k).values[-1])
    for tid, e in top.items():
        assert abs(e.logprob - float(lp_row[tid])) <= TOL, f"{where}: top entry {tid}"
        assert float(lp_row[tid]) >= kth - TOL, f"{where}: {tid} is not among the {k} largest"
    must = torch.nonzero(lp_row > kth + TOL).flatten().tolist()
    assert set(must) <= set(top), f"{where}: a clearly larger token is missing from the top-{k}"
    by_rank = sorted(top.values(), key=lambda e: e.rank)
    assert all(a.logprob >= b.logprob - TOL for a, b in zip(by_rank, by_rank[1:])), "ranks not by logprob"


def _check_output(hf, out, sp: SamplingParams) -> None:
    prompt = out.prompt_token_ids
    comp = out.outputs[0]
    tokens = prompt + comp.token_ids
    lp = _hf_logprobs(hf, tokens)
    P = len(prompt)
    # sampled-token logprobs: position P-1+j predicts output token j
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) == MAX_NEW
    for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        _check_position(entry, tok, lp[P - 1 + j], sp.logprobs, f"output {j} of prompt len {P}")
    total = sum(float(lp[P - 1 + j, t]) for j, t in enumerate(comp.token_ids))
    assert math.isclose(comp.cumulative_logprob, total, abs_tol=TOL * MAX_NEW)
    if sp.temperature == 0:
        assert all(entry[t].rank == 1 for t, entry in zip(comp.token_ids, comp.logprobs))
    # prompt logprobs: None for the first position, then position j-1 predicts prompt[j]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == P and plp[0] is None
    for j in range(1, P):
        _check_position(plp[j], prompt[j], lp[j - 1], sp.prompt_logprobs, f"prompt position {j} of {P}")


VARIANTS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(max_num_batched_tokens=32),  # + a 6-block KV cache
}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logprobs_match_transformers(tiny_model_factory, kind, variant):
    folder, hf = tiny_model_factory(kind)
    kw = dict(VARIANTS[variant])
    if variant == "preempt":
        kw["kv_cache_memory_bytes"] = kv_bytes(hf, 6, BLOCK)
    # max_logprobs=-1: some prompts ask for the whole vocabulary (vLLM's default cap is 20)
    llm = LLM(str(folder), backend="cpu", dtype="float32", block_size=BLOCK, max_logprobs=-1, **kw)
    params = [_params(i) for i in range(len(PROMPTS))]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    for out, sp in zip(outs, params):
        _check_output(hf, out, sp)
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
            _check_output(hf, b, sp)
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_logprobs_with_n_and_without_prompt_logprobs(tiny_model_factory):
    folder, hf = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", block_size=BLOCK)
    sp = SamplingParams(n=3, temperature=1.0, seed=5, logprobs=4, max_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPTS[2]}, sp, use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    assert len(out.outputs) == 3
    for comp in out.outputs:
        lp = _hf_logprobs(hf, PROMPTS[2] + comp.token_ids)
        P = len(PROMPTS[2])
        for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            _check_position(entry, tok, lp[P - 1 + j], 4, f"completion {comp.index} output {j}")
    plain = llm.generate({"prompt_token_ids": PROMPTS[2]},
                         SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)[0]
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
