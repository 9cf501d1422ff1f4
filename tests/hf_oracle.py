"""Hugging Face transformers as the oracle of the parity tests (float32, tiny random models).

Shared by tests/test_hf_parity.py, test_logprobs_hf.py, test_gemma.py, test_phi3.py,
test_moe_models.py and test_gguf_moe.py:

- `random_prompts`, `hf_greedy`, `hf_logprobs`: prompts and transformers' answers;
- `ENGINE_VARIANTS` / `engine`, `check_greedy_matches_hf`: greedy tokens plain, with chunked
  prefill and under forced preemption; `check_prefill_logits_match_hf`: every prompt position's
  logits;
- `LOGPROB_VARIANTS`, `LOGPROB_PROMPTS`, `logprob_params`, `check_logprobs_match_hf`,
  `check_logprobs_output`, `check_position`: sampled-token and prompt logprobs (top-k, ranks).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from polyrunner import LLM, SamplingParams
from tiny_models import kv_bytes

TOL = 1e-4   # logprobs, absolute (nats)
LOGITS_REL_TOL = 1e-4   # prefill logits, relative to the largest


def random_prompts(n: int = 8, vocab: int = 512, seed: int = 0, min_len: int = 3,
                   max_len: int = 60) -> list[list[int]]:
    """n prompts of token ids in [3, vocab), lengths drawn from [min_len, max_len)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(min_len, max_len))).tolist() for _ in range(n)]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """transformers' `generate`: max_new greedy tokens after prompt, no end of sequence."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits, one row per position of tokens."""
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_all_blocks_free(llm: LLM) -> None:
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


# ---------------------------------------------------------------- greedy tokens and prefill logits

ENGINE_VARIANTS = {
    "default": {},
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(enable_prefix_caching=False),  # + a KV budget of 12 blocks
}


def engine(folder, hf, variant: str, **llm_kwargs) -> LLM:
    """A float32 CPU engine (8 sequences, 16-token blocks) in one of ENGINE_VARIANTS; "preempt"
    gets a 12-block KV cache so that the prompts of the greedy tests preempt each other."""
    options = dict(ENGINE_VARIANTS[variant])
    if variant == "preempt":
        options["kv_cache_memory_bytes"] = kv_bytes(hf, 12)
    return LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=8, block_size=16, **options, **llm_kwargs)


def check_greedy_matches_hf(folder, hf, variant: str, prompts: list[list[int]], max_new: int, *,
                            want: list[list[int]] | None = None, label: str = "", finish_length: bool = False,
                            sampling: dict | None = None, **llm_kwargs) -> list:
    """The `engine(folder, hf, variant, **llm_kwargs)`'s max_new greedy tokens (ignore_eos, plus
    `sampling` options) equal transformers' (`want`, else `hf_greedy`) for every prompt; "preempt"
    preempted; every KV block free at the end; with finish_length each finished for "length".
    Returns the outputs (in prompt order) for further checks."""
    llm = engine(folder, hf, variant, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, **(sampling or {}))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref = want[i] if want is not None else hf_greedy(hf, p, max_new)
        assert out.outputs[0].token_ids == ref, f"{label}{variant} prompt len {len(p)}"
        if finish_length:
            assert out.outputs[0].finish_reason == "length"
    assert_all_blocks_free(llm)
    return outs


def check_prefill_logits_match_hf(folder, hf, prompts: list[list[int]], label: str = "") -> None:
    """Every prompt position's logits from one prefill step holding all prompts (the hidden
    states captured from `runner.executor.run`, through `compute_logits`) equal transformers'
    within LOGITS_REL_TOL relative to the largest."""
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=4)
    runner = llm.engine.runner
    captured = []
    run = runner.executor.run
    runner.executor.run = (
        lambda inputs: captured.append((run(inputs), inputs.attn.num_actual_tokens)) or captured[-1][0])
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=1),
                 use_tqdm=False)
    hidden, T = captured[0]  # one prefill step holds all the prompts
    assert T == sum(map(len, prompts))
    ours = runner.model.compute_logits(hidden[:T])
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        rel = (ours[start:start + len(p)] - ref).abs().max() / ref.abs().max()
        assert rel < LOGITS_REL_TOL, f"{label}relative error {rel:.2e}"
        start += len(p)


# ---------------------------------------------------------------- logprobs

LOGPROB_BLOCK = 16
LOGPROB_MAX_NEW = 6
LOGPROB_PROMPTS = [np.random.default_rng(11).integers(3, 512, size=k).tolist() for k in (5, 23, 40, 57)]
# (logprobs, prompt_logprobs, temperature): top-k, none, full vocabulary, greedy
LOGPROB_REQUESTS = [(5, 5, 0.8), (0, 0, 0.8), (-1, 3, 0.0), (2, -1, 1.0)]
LOGPROB_VARIANTS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(max_num_batched_tokens=32),  # + a 6-block KV cache
}


def logprob_params(i: int) -> SamplingParams:
    """Request i's sampling parameters: LOGPROB_REQUESTS in turn, seed 70 + i, LOGPROB_MAX_NEW tokens."""
    lp, plp, temp = LOGPROB_REQUESTS[i % len(LOGPROB_REQUESTS)]
    return SamplingParams(temperature=temp, seed=70 + i, logprobs=lp, prompt_logprobs=plp,
                          max_tokens=LOGPROB_MAX_NEW, ignore_eos=True)


def check_position(entry, token: int, lp_row: torch.Tensor, k: int, where: str) -> None:
    """One position's entry against the oracle's logprob row: the actual token's logprob and
    rank, and the top-k entries (the k largest, ranked 1..k; k < 0: the whole vocabulary)."""
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


def check_logprobs_output(hf, out, sp: SamplingParams) -> None:
    """One request's sampled-token logprobs, cumulative logprob and prompt logprobs against
    one transformers forward over prompt + completion."""
    prompt = out.prompt_token_ids
    comp = out.outputs[0]
    tokens = prompt + comp.token_ids
    lp = hf_logprobs(hf, tokens)
    P = len(prompt)
    # sampled-token logprobs: position P-1+j predicts output token j
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) == LOGPROB_MAX_NEW
    for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        check_position(entry, tok, lp[P - 1 + j], sp.logprobs, f"output {j} of prompt len {P}")
    total = sum(float(lp[P - 1 + j, t]) for j, t in enumerate(comp.token_ids))
    assert math.isclose(comp.cumulative_logprob, total, abs_tol=TOL * LOGPROB_MAX_NEW)
    if sp.temperature == 0:
        assert all(entry[t].rank == 1 for t, entry in zip(comp.token_ids, comp.logprobs))
    # prompt logprobs: None for the first position, then position j-1 predicts prompt[j]
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == P and plp[0] is None
    for j in range(1, P):
        check_position(plp[j], prompt[j], lp[j - 1], sp.prompt_logprobs, f"prompt position {j} of {P}")


def check_logprobs_match_hf(folder, hf, variant: str, prompts: list[list[int]] = LOGPROB_PROMPTS,
                            **llm_kwargs) -> tuple[LLM, list, list[SamplingParams]]:
    """A float32 CPU engine (LOGPROB_BLOCK-token blocks, max_logprobs=-1: some requests ask for
    the whole vocabulary) in one of LOGPROB_VARIANTS ("preempt": a 6-block KV cache, and it
    must preempt) runs `prompts` with `logprob_params`; every output passes
    `check_logprobs_output`. Returns (engine, outputs, parameters) for further checks."""
    kw = dict(LOGPROB_VARIANTS[variant])
    if variant == "preempt":
        kw["kv_cache_memory_bytes"] = kv_bytes(hf, 6, LOGPROB_BLOCK)
    llm = LLM(str(folder), backend="cpu", dtype="float32", block_size=LOGPROB_BLOCK, max_logprobs=-1, **kw,
              **llm_kwargs)
    params = [logprob_params(i) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if variant == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0
    for out, sp in zip(outs, params):
        check_logprobs_output(hf, out, sp)
    return llm, outs, params
