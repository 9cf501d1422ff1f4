"""vLLM offline-API parity: names, behaviour and error wording of `LLM`,
`SamplingParams` and the engine limits, checked against vLLM 0.10.2's.

vLLM references (wording copied where the test matches text):
- vllm/v1/engine/processor.py: "The decoder prompt cannot be empty",
  "Token id {id} is out of vocabulary", "Requested sample logprobs of {n},
  which is greater than max allowed: {max}" (and "prompt logprobs");
- vllm/sampling_params.py: "min_tokens must be greater than or equal to 0, got
  {v}." and "min_tokens must be less than or equal to max_tokens={m}, got {v}.";
  BeamSearchParams;
- vllm/engine/llm_engine.py (V0): "Got priority {p} but Priority scheduling is
  not enabled.";
- vllm/v1/sample/sampler.py: logprobs_mode raw/processed logprobs/logits;
- vllm/v1/core/sched/scheduler.py: priority policy (queue by (priority,
  arrival); preempt the running request with the largest (priority, arrival));
- vllm/entrypoints/llm.py + vllm/beam_search.py: LLM.beam_search;
- vllm/model_executor/layers/logits_processor.py (V0): per-request
  logits_processors called as fn(output_ids, row) or fn(prompt_ids, output_ids, row).
Some tests are ports of vLLM's own end-to-end tests (tests/entrypoints/llm/
test_prompt_validation.py, tests/v1/sample/test_sampling_params_e2e.py,
tests/samplers/test_logprobs.py::test_max_logprobs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyrunner import LLM, SamplingParams
from polyrunner.beam_search import BeamSearchOutput, get_beam_search_score
from polyrunner.config import SchedulerConfig
from polyrunner.device.backend import Capabilities
from polyrunner.engine.kv_manager import KVCacheManager
from polyrunner.engine.request import Request
from polyrunner.engine.scheduler import Scheduler
from polyrunner.sampling_params import BeamSearchParams
from test_stop_strings_engine import make_tokenizer_folder
from tolerances import gamma

VOCAB = 512
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
P1 = {"prompt_token_ids": [5, 6, 7, 8]}
P2 = {"prompt_token_ids": [9, 10, 11]}


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    return LLM(str(folder), backend="cpu", dtype="float32", max_model_len=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def tok_llm(tiny_model_factory, tmp_path_factory):
    folder, _ = tiny_model_factory("llama")
    out = make_tokenizer_folder(folder, tmp_path_factory.mktemp("parity-tok"))
    return LLM(str(out), backend="cpu", dtype="float32", max_num_seqs=8)


def _idle(llm: LLM) -> bool:
    pool = llm.engine.kv.pool
    return not llm.engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_usable_blocks


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


# ---- prompts: empty, out of vocabulary, every prompt invalid ----------------------------
def test_empty_prompt(tok_llm):   # vLLM tests/entrypoints/llm/test_prompt_validation.py
    with pytest.raises(ValueError, match="decoder prompt cannot be empty"):
        tok_llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="^The decoder prompt cannot be empty$"):
        tok_llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    assert _idle(tok_llm)


def test_out_of_vocab_token(llm):   # vLLM tests/entrypoints/llm/test_prompt_validation.py
    with pytest.raises(ValueError, match="out of vocabulary") as exc:
        llm.generate({"prompt_token_ids": [999999]}, use_tqdm=False)
    assert "Token id 999999 is out of vocabulary" in str(exc.value)
    assert "prompt_token_ids" in str(exc.value) and "[0, 511]" in str(exc.value)


def test_every_prompt_invalid_raises_the_first_error(llm):
    with pytest.raises(ValueError, match="^The decoder prompt cannot be empty$"):
        llm.generate([{"prompt_token_ids": []}, {"prompt_token_ids": [5, 99999]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="Token id 99999 is out of vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 99999]}, {"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    assert _idle(llm)
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_a_bad_prompt_among_good_ones_gets_an_error_output(tok_llm):
    outs = tok_llm.generate(["", "kato rime"], GREEDY, use_tqdm=False)
    assert outs[0].error == "The decoder prompt cannot be empty" and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4


def test_text_prompt_dict(tok_llm):
    """vLLM's TextPrompt form {"prompt": text} tokenizes like a plain string."""
    a = tok_llm.generate({"prompt": "kato rime su"}, GREEDY, use_tqdm=False)[0]
    b = tok_llm.generate("kato rime su", GREEDY, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids


# ---- prompt_token_ids must be integers ----------------------------------------------------
@pytest.mark.parametrize("ids", [[5, 5.7], [5.0], ["5"], [5, True], [False], [[1, 2]], "123", None, 5, {"a": 1},
                                 [5, None]],
                         ids=repr)
def test_prompt_token_ids_must_be_integers(llm, ids):
    with pytest.raises(ValueError) as exc:
        llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    msg = str(exc.value)
    assert "prompt_token_ids must be a list of integers in the allowed range [0, 511]" in msg, msg
    assert _idle(llm)


def test_prompt_token_ids_integer_kinds_accepted(llm):
    want = llm.generate(P1, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for ids in (tuple(P1["prompt_token_ids"]), np.array(P1["prompt_token_ids"]),
                [np.int64(t) for t in P1["prompt_token_ids"]], np.array(P1["prompt_token_ids"], np.int32)):
        out = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids == P1["prompt_token_ids"] and out.outputs[0].token_ids == want


def test_bad_token_ids_do_not_affect_the_others(llm):
    solo = [o.outputs[0].token_ids for o in llm.generate([P1, P2], GREEDY, use_tqdm=False)]
    outs = llm.generate([P1, {"prompt_token_ids": [5, 5.7]}, P2, {"prompt_token_ids": ["7"]}], GREEDY,
                        use_tqdm=False)
    assert [o.error is None for o in outs] == [True, False, True, False]
    assert "got 5.7 of type float at index 1" in outs[1].error
    assert "got '7' of type str at index 0" in outs[3].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == solo
    assert _idle(llm)


# ---- n and max_logprobs limits -------------------------------------------------------------
@pytest.mark.parametrize("n", [5, 10000])
def test_n_is_capped(llm, n):
    with pytest.raises(ValueError, match=rf"n must be in \[1, 4\] \(got {n}\).*max_num_seqs=4"):
        llm.generate(P1, SamplingParams(n=n, max_tokens=2), use_tqdm=False)
    assert _idle(llm)
    outs = llm.generate(P1, SamplingParams(n=4, max_tokens=2, seed=1), use_tqdm=False)
    assert len(outs[0].outputs) == 4


def test_max_logprobs_default_is_vllms(llm):
    assert llm.engine.config.model.max_logprobs == 20
    cases = [(dict(logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
             (dict(prompt_logprobs=21), "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
             (dict(logprobs=-1), "Requested sample logprobs of 512, which is greater than max allowed: 20"),
             (dict(prompt_logprobs=-1), "Requested prompt logprobs of 512, which is greater than max allowed: 20"),
             (dict(logprobs=100000), "Requested sample logprobs of 100000, which is greater than max allowed: 20")]
    for kw, message in cases:
        with pytest.raises(ValueError) as exc:
            llm.generate(P1, SamplingParams(max_tokens=2, **kw), use_tqdm=False)
        assert str(exc.value) == message
    out = llm.generate(P1, SamplingParams(max_tokens=2, logprobs=20, prompt_logprobs=20), use_tqdm=False)[0]
    assert all(len(pos) in (20, 21) for pos in out.outputs[0].logprobs)
    assert _idle(llm)


def test_max_logprobs(tiny_model_factory):   # vLLM tests/samplers/test_logprobs.py::test_max_logprobs
    folder, _ = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_logprobs=1, max_model_len=64)
    llm.generate(P1, SamplingParams(logprobs=1, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="Requested sample logprobs of 2, which is greater than max allowed: 1"):
        llm.generate(P1, SamplingParams(logprobs=2, max_tokens=2), use_tqdm=False)
    full = LLM(str(folder), backend="cpu", dtype="float32", max_logprobs=-1, max_model_len=64)
    out = full.generate(P1, SamplingParams(logprobs=-1, prompt_logprobs=-1, max_tokens=2), use_tqdm=False)[0]
    assert all(len(pos) == VOCAB for pos in out.outputs[0].logprobs)
    assert all(len(pos) == VOCAB for pos in out.prompt_logprobs[1:])


# ---- min_tokens wording, tokenizer, detokenize=False ----------------------------------------
def test_min_tokens_messages_are_vllms():
    with pytest.raises(ValueError, match=r"min_tokens must be greater than or equal to 0, got -1\."):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match=r"min_tokens must be less than or equal to max_tokens=3, got 4\."):
        SamplingParams(min_tokens=4, max_tokens=3)


def test_get_tokenizer(llm, tok_llm):
    assert tok_llm.get_tokenizer() is tok_llm.engine.tokenizer is not None
    assert tok_llm.get_tokenizer().decode(tok_llm.get_tokenizer().encode("kato", add_special_tokens=False)) == "kato"
    assert llm.get_tokenizer() is None and llm.engine.get_tokenizer() is None


def test_detokenize_false(tok_llm):   # vLLM tests/v1/sample/test_sampling_params_e2e.py::test_detokenize_false
    out = tok_llm.generate("kato rime", SamplingParams(detokenize=False, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0 and out.outputs[0].text == ""
    out = tok_llm.generate("kato rime", SamplingParams(detokenize=False, logprobs=3, prompt_logprobs=3,
                                                       max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].logprobs and out.prompt_logprobs[1:]
    for position in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        assert all(lp.decoded_token is None for lp in position.values())
    # detokenize=True (the default) fills decoded_token
    out = tok_llm.generate("kato rime", SamplingParams(logprobs=3, prompt_logprobs=3, max_tokens=4),
                           use_tqdm=False)[0]
    for position in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        assert all(isinstance(lp.decoded_token, str) for lp in position.values())


# ---- other vLLM end-to-end sampling tests (tests/v1/sample/test_sampling_params_e2e.py) --------
def test_allowed_token_ids(llm):
    out = llm.generate(P1, SamplingParams(allowed_token_ids=[10], max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [10] * 5
    with pytest.raises(ValueError):
        llm.generate(P1, SamplingParams(allowed_token_ids=[10000000]), use_tqdm=False)
    with pytest.raises(ValueError):
        SamplingParams(allowed_token_ids=[])


def test_n_gt_1(llm):
    out = llm.generate(P1, SamplingParams(n=3, max_tokens=6, seed=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]


def test_multiple_sampling_params(llm):   # vLLM tests/entrypoints/llm/test_generate.py
    params = [SamplingParams(temperature=0.01, top_p=0.95), SamplingParams(temperature=0.3, top_p=0.95)]
    assert len(llm.generate([P1, P2], params, use_tqdm=False)) == 2
    with pytest.raises(ValueError):
        llm.generate([P1, P2, P1], params, use_tqdm=False)
    assert len(llm.generate([P1, P2], None, use_tqdm=False)) == 2


# ---- engine arguments vLLM's LLM takes ---------------------------------------------------------
def test_scheduler_and_cache_arguments(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", long_prefill_token_threshold=4,
              num_gpu_blocks_override=40, gpu_memory_utilization=0.5, max_model_len=64)
    cfg = llm.engine.config
    assert cfg.scheduler.long_prefill_token_threshold == 4
    assert cfg.cache.num_blocks_override == 40 and llm.engine.runner.num_blocks == 40
    assert cfg.cache.memory_utilization == 0.5
    prompt = {"prompt_token_ids": list(range(3, 23))}
    llm.engine.add_request(prompt, GREEDY)
    first = llm.engine.scheduler.schedule()
    assert first.num_scheduled.tolist() == [4]   # a 20-token prefill is taken 4 tokens a step
    llm.engine.abort_request("0")
    assert _idle(llm)
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    ref = LLM(str(folder), backend="cpu", dtype="float32", max_model_len=64).generate(prompt, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="policy"):
        LLM(str(folder), backend="cpu", scheduling_policy="lifo")
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(str(folder), backend="cpu", logprobs_mode="logits")


# ---- priority scheduling -------------------------------------------------------------------------
def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match=r"^Got priority 1 but Priority scheduling is not enabled\.$"):
        llm.generate(P1, GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate([P1, P2], GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.engine.add_request(P1, GREEDY, priority=1.5)
    assert _idle(llm)
    llm.generate(P1, GREEDY, use_tqdm=False, priority=[0])   # 0 is every request's default


def _finish_order(llm: LLM, priorities: list[int]) -> list[str]:
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": [5 + i, 6, 7]}, GREEDY, request_id=f"r{i}", priority=p)
           for i, p in enumerate(priorities)]
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert sorted(order) == sorted(ids)
    return order


def test_priority_order(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=1, scheduling_policy="priority",
              max_model_len=64)
    assert _finish_order(llm, [2, 0, 1]) == ["r1", "r2", "r0"]   # lower value first
    assert _finish_order(llm, [1, 1, 0, 1]) == ["r2", "r0", "r1", "r3"]   # ties by arrival
    assert _finish_order(llm, [-5, 3, 3]) == ["r0", "r1", "r2"]
    # outputs still come back in prompt order, and match FCFS's tokens
    prompts = [P1, P2, {"prompt_token_ids": [20, 21]}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[3, 1, 2])
    fcfs = LLM(str(folder), backend="cpu", dtype="float32", max_model_len=64).generate(prompts, GREEDY,
                                                                                       use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in fcfs]
    assert _idle(llm)


def _decode_step(sched: Scheduler):
    so = sched.schedule()
    sched.update(so, np.full(so.num_reqs, 100, np.int64))
    return so


@pytest.mark.parametrize("policy, victim", [("fcfs", "c"), ("priority", "b")])
def test_preemption_victim(policy, victim):
    """3 running requests of one block each, 1 free block, each decode needs a new block:
    FCFS preempts the newest (c), priority the one with the largest priority value (b)."""
    kv = KVCacheManager(5, 4, False)   # 4 usable blocks of 4 tokens
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, policy=policy), kv, 64)
    for rid, prio in (("a", 0), ("b", 5), ("c", 1)):
        sched.add_request(Request(rid, [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True), 20,
                                  priority=prio))
    _decode_step(sched)        # prefill: 3 tokens each, one block each
    _decode_step(sched)        # position 3 still fits the first block
    so = _decode_step(sched)   # position 4 needs a second block each: one request must go
    assert so.preempted_req_ids == {victim}
    assert sorted(r.request_id for r in so.requests) == sorted({"a", "b", "c"} - {victim})
    assert [r.request_id for r in sched.waiting] == [victim]


def test_priority_queue_puts_a_preempted_request_back_in_order():
    kv = KVCacheManager(64, 4, False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, policy="priority"), kv, 64)
    reqs = {rid: Request(rid, [5, 6], SamplingParams(max_tokens=4), 4, priority=p)
            for rid, p in (("x", 1), ("y", 0), ("z", 1))}
    for r in reqs.values():
        sched.add_request(r)
    assert [r.request_id for r in sched.waiting] == ["y", "x", "z"]
    so = _decode_step(sched)
    assert [r.request_id for r in so.requests] == ["y"]
    sched._preempt(sched._victim(), so)
    assert [r.request_id for r in sched.waiting] == ["y", "x", "z"]   # (0, arrival 1) first again


# ---- logprobs_mode -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mode_llms(tiny_model_factory):
    folder, hf = tiny_model_factory("llama")
    return hf, {mode: LLM(str(folder), backend="cpu", dtype="float32", max_model_len=64, logprobs_mode=mode)
                for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")}


def _check_values(entry: dict, want: torch.Tensor, where: str) -> None:
    for tok, lp in entry.items():
        w = float(want[tok])
        if math.isinf(w):
            assert lp.logprob == w, f"{where}: token {tok} {lp.logprob} vs {w}"
        else:
            assert abs(lp.logprob - w) < 1e-4, f"{where}: token {tok} {lp.logprob} vs {w}"


def test_logprobs_mode(mode_llms):
    hf, llms = mode_llms
    prompt = [5, 17, 33, 60, 2, 99]
    logits0 = _hf_logits(hf, prompt)[-1]
    biased = int(torch.topk(logits0, 3).indices[2])   # the third best token, pushed to the top
    cases = {
        "greedy+bias": SamplingParams(temperature=0, max_tokens=3, logprobs=5, logit_bias={biased: 4.0},
                                      prompt_logprobs=2),
        "random": SamplingParams(temperature=2.0, top_k=3, seed=11, max_tokens=3, logprobs=5),
        "min_p": SamplingParams(temperature=0.7, min_p=0.9, seed=12, max_tokens=3, logprobs=5),
    }
    for mode, llm in llms.items():
        for name, sp in cases.items():
            out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
            comp = out.outputs[0]
            tokens = prompt + comp.token_ids
            for i, entry in enumerate(comp.logprobs):
                raw = _hf_logits(hf, tokens[:len(prompt) + i])[-1]
                processed = raw.clone()
                if sp.logit_bias:
                    processed[biased] += 4.0
                if not sp.is_greedy:
                    processed = processed / sp.temperature
                    if sp.top_k:
                        processed[processed < torch.topk(processed, sp.top_k).values[-1]] = -math.inf
                    if sp.min_p:
                        probs = torch.softmax(processed, -1)
                        processed[probs < probs.max() * sp.min_p] = -math.inf
                want = {"raw_logprobs": torch.log_softmax(raw, -1), "raw_logits": raw,
                        "processed_logprobs": torch.log_softmax(processed, -1), "processed_logits": processed}[mode]
                _check_values(entry, want, f"{mode} {name} position {i}")
                if name in ("random", "min_p") and mode.startswith("processed"):   # top-5 of a top-3 filter
                    assert sum(math.isinf(lp.logprob) for lp in entry.values()) >= 2
            if name == "greedy+bias":
                assert comp.token_ids[0] == biased
                # prompt logprobs are always raw logprobs (vLLM computes them apart from the sampler)
                _check_values(out.prompt_logprobs[-1], torch.log_softmax(_hf_logits(hf, prompt)[-2], -1),
                              f"{mode} prompt logprobs")


def test_processed_logprobs_of_a_greedy_row_in_a_mixed_batch(mode_llms):
    """A greedy row keeps no top-k filter (vLLM resets it), also next to a random row."""
    hf, llms = mode_llms
    prompt = [5, 17, 33, 60]
    greedy = SamplingParams(temperature=0, top_k=2, max_tokens=2, logprobs=5, ignore_eos=True)
    random = SamplingParams(temperature=1.0, top_k=2, seed=3, max_tokens=2, logprobs=5, ignore_eos=True)
    outs = llms["processed_logprobs"].generate([{"prompt_token_ids": prompt}] * 2, [greedy, random],
                                               use_tqdm=False)
    g, r = outs[0].outputs[0], outs[1].outputs[0]
    want = torch.log_softmax(_hf_logits(hf, prompt)[-1], -1)
    _check_values(g.logprobs[0], want, "greedy row")
    assert not any(math.isinf(lp.logprob) for lp in g.logprobs[0].values())
    assert sum(math.isinf(lp.logprob) for lp in r.logprobs[0].values()) >= 3


def test_backend_without_the_feature_rejects(mode_llms, monkeypatch):
    from polyrunner.backends.xla.plugin import XLA_SAMPLING
    assert not {"raw_logits", "processed_logprobs", "processed_logits", "logits_processors"} & XLA_SAMPLING
    _, llms = mode_llms
    for mode, llm in llms.items():
        monkeypatch.setattr(llm.engine.backend, "capabilities", Capabilities(sampling=XLA_SAMPLING))
        sp = SamplingParams(max_tokens=2, logprobs=2)
        if mode == "raw_logprobs":
            llm.generate(P1, sp, use_tqdm=False)
        else:
            with pytest.raises(ValueError, match=rf"does not support sampling features \['{mode}'\]"):
                llm.generate(P1, sp, use_tqdm=False)
            llm.generate(P1, SamplingParams(max_tokens=2), use_tqdm=False)   # no logprobs: no mode needed
        with pytest.raises(ValueError, match=r"does not support sampling features \['logits_processors'\]"):
            llm.generate(P1, SamplingParams(max_tokens=2, logits_processors=[lambda out, row: row]),
                         use_tqdm=False)
        assert _idle(llm)


# ---- per-request logits processors -----------------------------------------------------------
def _force(token: int):
    def force(output_ids, row):
        forced = torch.full_like(row, -math.inf)
        forced[token] = 0.0
        return forced
    return force


def test_logits_processor_forces_tokens_of_its_own_request_only(llm):
    plain = llm.generate([P1, P2], GREEDY, use_tqdm=False)
    forced = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logits_processors=[_force(42)])
    outs = llm.generate([P1, P2], [forced, GREEDY], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [42] * 4
    assert outs[1].outputs[0].token_ids == plain[1].outputs[0].token_ids
    random = SamplingParams(temperature=1.0, seed=2, max_tokens=4, ignore_eos=True, logits_processors=[_force(43)])
    assert llm.generate(P1, random, use_tqdm=False)[0].outputs[0].token_ids == [43] * 4


def test_logits_processor_arguments(tiny_model_factory):
    """2 parameters: (output ids, row); 3: (prompt ids, output ids, row); called once per
    sampled token, also when the prompt is prefilled over several steps; applied in order."""
    folder, _ = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_model_len=64, long_prefill_token_threshold=4)
    calls2, calls3 = [], []

    def two(output_ids, row):
        calls2.append(list(output_ids))
        return row

    def three(prompt_ids, output_ids, row):
        calls3.append((tuple(prompt_ids), list(output_ids), row.shape))
        row = row.clone()
        row[7] = 1e9
        return row

    prompt = list(range(3, 21))
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logits_processors=[two, three])
    out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [7] * 5
    assert calls2 == [[7] * i for i in range(5)]
    assert calls3 == [(tuple(prompt), [7] * i, (VOCAB,)) for i in range(5)]
    # the params object is shared, not copied, by the n completions and by clone()
    assert sp.clone().logits_processors[1] is three
    # raw logprobs are taken before the processors, as vLLM's raw mode
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                                    logits_processors=[_force(9)]),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [9] and out.outputs[0].logprobs[0][9].logprob > -math.inf
    assert out.outputs[0].logprobs[0][9].rank >= 1


def test_logits_processor_signature_checked():
    with pytest.raises(ValueError, match=r"logits_processors\[0\] must take \(output_token_ids, logits\)"):
        SamplingParams(logits_processors=[lambda a, b, c, d: d])


# ---- beam search -------------------------------------------------------------------------------
def _oracle_beam_search(hf, prompt, width, max_tokens, eos, ignore_eos, length_penalty=1.0):
    """vLLM's algorithm over transformers' logits (greedy steps: the top 2*width tokens)."""
    def score(beam):
        return get_beam_search_score(beam[0], beam[1], eos, length_penalty)
    beams, completed = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not beams:
            break
        fresh = []
        for tokens, cum in beams:
            top = torch.topk(torch.log_softmax(_hf_logits(hf, tokens)[-1], -1), 2 * width)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                (completed if tid == eos and not ignore_eos else fresh).append((tokens + [tid], cum + lp))
        beams = sorted(fresh, key=score, reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width], completed


def test_beam_search_matches_the_algorithm(tiny_model_factory):
    folder, hf = tiny_model_factory("llama")
    llm = LLM(str(folder), backend="cpu", dtype="float32", max_model_len=64, max_num_seqs=16)
    rng = np.random.default_rng(5)
    prompts, found_eos = [], False
    for _ in range(40):   # include a prompt whose search completes a beam with EOS
        prompt = rng.integers(3, VOCAB, size=6).tolist()
        if _oracle_beam_search(hf, prompt, 3, 6, 2, False)[1]:
            prompts.append(prompt)
            found_eos = True
            break
    assert found_eos
    prompts.append(rng.integers(3, VOCAB, size=9).tolist())
    for ignore_eos, penalty in ((False, 1.0), (True, 0.5)):
        params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=ignore_eos, length_penalty=penalty)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        assert all(isinstance(o, BeamSearchOutput) for o in outs)
        for prompt, out in zip(prompts, outs):
            want, _ = _oracle_beam_search(hf, prompt, 3, 6, 2, ignore_eos, penalty)
            assert [s.tokens for s in out.sequences] == [w[0] for w in want]
            for seq, (_, cum) in zip(out.sequences, want):
                assert abs(seq.cum_logprob - cum) < 1e-3
                assert len(seq.logprobs) == len(seq.tokens) - len(prompt)
                assert seq.text is None   # no tokenizer
    assert _idle(llm)


def test_beam_width_one_is_greedy(tok_llm):
    prompt = "kato rime su"
    greedy = tok_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                              use_tqdm=False)[0]
    out = tok_llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))[0]
    (seq,) = out.sequences
    assert seq.tokens == greedy.prompt_token_ids + greedy.outputs[0].token_ids
    assert seq.text == tok_llm.get_tokenizer().decode(seq.tokens, skip_special_tokens=False)
    best = [max(p.values(), key=lambda lp: lp.logprob).logprob for p in seq.logprobs]
    # the same float32 logprobs summed in float32 or float64, in any order
    assert abs(seq.cum_logprob - math.fsum(best)) <= gamma(len(best)) * math.fsum(map(abs, best))


def test_beam_search_limits(llm):
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=-1.0)
    # 2 * beam_width logprobs per step: beyond max_logprobs (20), as in vLLM
    with pytest.raises(ValueError, match="Requested sample logprobs of 22, which is greater than max allowed: 20"):
        llm.beam_search([P1], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="The decoder prompt cannot be empty"):
        llm.beam_search([{"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=2))
    # beams that reach max_model_len are complete there
    long = {"prompt_token_ids": list(range(3, 3 + 60))}
    out = llm.beam_search([long, P1], BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True))
    assert [(len(s.tokens), s.finish_reason) for s in out[0].sequences] == [(64, "length")] * 2
    assert all(len(s.tokens) == len(P1["prompt_token_ids"]) + 8 for s in out[1].sequences)
    assert _idle(llm)


def test_a_failing_logits_processor_fails_its_request_only(llm):
    """User code that raises (or returns a wrong shape) ends its own request with
    finish_reason "error" and the error text; the batch's other requests go on,
    and every block and slot is freed."""
    def boom(output_ids, row):
        if len(output_ids) == 2:
            raise RuntimeError("user bug")
        return row

    plain = llm.generate([P1, P2], GREEDY, use_tqdm=False)
    bad = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logits_processors=[boom])
    wrong = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                           logits_processors=[lambda out, row: row[:3]])
    outs = llm.generate([P1, P2, P1], [bad, GREEDY, wrong], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "RuntimeError: user bug" in outs[0].error
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids[:2]
    assert outs[1].error is None and outs[1].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert outs[2].outputs[0].finish_reason == "error" and "must return the logits row" in outs[2].error
    assert outs[2].outputs[0].token_ids == []
    eng = llm.engine
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_usable_blocks
    assert eng.runner.states.num_active == 0 and not eng.scheduler.requests
