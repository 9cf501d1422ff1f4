"""Asynchronous scheduling equals synchronous scheduling, token for token, on CPU.

The CPU backend declines asynchronous scheduling (its copies are synchronous);
here a test backend forces it: its `to_host_async` returns a future whose host
tensor holds garbage until `result()` is called, as a real asynchronous copy
would, so a runner that reads tokens before waiting, or feeds the next step
from the host, gets wrong tokens. The same backend with async_scheduling=False
is the synchronous reference (identical numerics).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from polyrunner import LLM, SamplingParams
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.device.backend import HostFuture
from polyrunner.device.buckets import BucketPolicy, exponential_sizes
from polyrunner.plugins import hookimpl, register
from polyrunner.plugins.manager import unregister
from polyrunner.tools.conformance import run_conformance
from test_stop_strings_engine import make_tokenizer_folder
from tiny_models import build_tiny_model

EOS = 2


class DeferredCopyCPU(CPUBackend):
    """CPU with a deferred device->host copy: the host tensor is filled only when
    waited for. Records the order of model runs and of waits for tokens."""

    name = "cpu-deferred-copy"
    priority = -100
    capabilities = dataclasses.replace(CPUBackend.capabilities, async_scheduling=True)
    events: list[str] = []

    def make_executor(self, model):
        executor = super().make_executor(model)
        run = executor.run

        def logged(inputs):
            self.events.append("run")
            return run(inputs)
        executor.run = logged
        return executor

    def to_host_async(self, tensor: torch.Tensor) -> HostFuture:
        host = torch.full(tensor.shape, -5, dtype=tensor.dtype)

        def wait() -> None:
            self.events.append("wait")
            host.copy_(tensor)
        return HostFuture(host, wait=wait)


class NeverCopiedCPU(DeferredCopyCPU):
    """Broken: claims asynchronous copies but the host tensor is never filled."""

    name = "broken-never-copied"

    def to_host_async(self, tensor: torch.Tensor) -> HostFuture:
        return HostFuture(torch.zeros(tensor.shape, dtype=tensor.dtype))


class DeferredCopyPaddedCPU(DeferredCopyCPU):
    """The same, padding every step to power-of-two token and request buckets."""

    name = "cpu-deferred-copy-padded"
    capabilities = dataclasses.replace(DeferredCopyCPU.capabilities, static_shapes=True)

    def bucket_policy(self):
        s = self.config.scheduler
        return BucketPolicy(exponential_sizes(1, s.max_num_batched_tokens), exponential_sizes(1, s.max_num_seqs))


class _Plugin:
    PLUGIN_API_VERSION = "1.0"
    @hookimpl
    def polyrunner_backends(self):
        return [DeferredCopyCPU, DeferredCopyPaddedCPU, NeverCopiedCPU]


@pytest.fixture(scope="module", autouse=True)
def backends():
    register(_Plugin(), name="test-async-scheduling")
    yield
    unregister("test-async-scheduling")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", model)
    return make_tokenizer_folder(model, tmp_path_factory.mktemp("tiny-llama-tok"))


def make_llm(folder, asynchronous: bool | None, **kw) -> LLM:
    args = dict(backend=DeferredCopyCPU.name, max_num_seqs=5, max_num_batched_tokens=32,
                num_gpu_blocks_override=14, max_model_len=256)
    args.update(kw)
    return LLM(str(folder), async_scheduling=asynchronous, **args)


def _logprobs(positions) -> tuple[list, list]:
    """(exact part: token ids, ranks, decoded text; float part: the logprobs)."""
    if positions is None:
        return [], []
    exact = [[(t, lp.rank, lp.decoded_token) for t, lp in p.items()] if p else None for p in positions]
    values = [lp.logprob for p in positions if p for lp in p.values()]
    return exact, values


def summary(outputs) -> tuple[list, list]:
    """Everything a request returns: (what must be equal, floats that may differ in
    the last bits: a batch of another size sums in another order)."""
    exact, floats = [], []
    for o in outputs:
        pe, pv = _logprobs(o.prompt_logprobs)
        exact.append(pe)
        floats.append(pv)
        for c in o.outputs:
            ce, cv = _logprobs(c.logprobs)
            exact.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, ce))
            floats.append(cv + ([c.cumulative_logprob] if c.cumulative_logprob is not None else []))
    return exact, floats


def follow_last(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A logits processor that reads the output so far: the next token is a function
    of the last one (so a processor shown a stale output writes other tokens)."""
    if token_ids:
        keep = (token_ids[-1] * 7 + 3) % 500
        logits[:keep] = float("-inf")
        logits[keep + 1:] = float("-inf")
    return logits


def workload(folder) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of mixed lengths (longer than the token budget: chunked prefill) and
    mixed params; stop strings and stop ids are picked from a probe run so that
    they really stop requests mid-way."""
    rng = np.random.default_rng(0)
    lengths = [5, 40, 1, 70, 33, 12, 90, 7, 3, 20]
    prompts = [{"prompt_token_ids": rng.integers(3, 500, size=n).tolist()} for n in lengths]
    probe = make_llm(folder, False).generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    text = probe[1].outputs[0].text
    stop_string = text[len(text) // 2:len(text) // 2 + 2]
    stop_id = probe[3].outputs[0].token_ids[9]
    params = [
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=24, stop=[stop_string]),
        SamplingParams(temperature=0.9, seed=7, max_tokens=18, logprobs=2, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=2, logprobs=1, prompt_logprobs=2),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, min_tokens=4, stop_token_ids=[EOS]),
        SamplingParams(temperature=0, max_tokens=9, logits_processors=[follow_last]),
        SamplingParams(temperature=1.0, seed=11, max_tokens=40, top_k=20, top_p=0.9),
        SamplingParams(temperature=0, max_tokens=16, stop=[stop_string], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=3, logit_bias={EOS: 30.0}),   # EOS after 3
    ]
    return prompts, params


@pytest.mark.parametrize("kw", [
    dict(),                                                      # chunked prefill, preemption, prefix cache
    dict(enable_prefix_caching=False, max_num_batched_tokens=256, enable_chunked_prefill=False,
         num_gpu_blocks_override=40, max_num_seqs=3),
    dict(backend=DeferredCopyPaddedCPU.name),                   # steps padded to buckets
], ids=["chunked-preempt", "whole-prefills", "padded"])
def test_async_equals_sync(folder, kw):
    prompts, params = workload(folder)
    results, preemptions = {}, {}
    for asynchronous in (False, True):
        llm = make_llm(folder, asynchronous, **kw)
        assert llm.engine.async_scheduling is asynchronous
        results[asynchronous] = summary(llm.generate(prompts, params, use_tqdm=False))
        preemptions[asynchronous] = llm.engine.scheduler.num_preemptions
        kv = llm.engine.kv
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks and not kv.blocks
        assert llm.engine.scheduler.slots.num_free == llm.engine.config.scheduler.max_num_seqs
        assert not llm.engine.has_unfinished_requests()
    (exact, floats), (exact_async, floats_async) = results[False], results[True]
    for i, (sync, asyn) in enumerate(zip(exact, exact_async)):
        assert asyn == sync, f"entry {i}: asynchronous {asyn} vs synchronous {sync}"
    for sync, asyn in zip(floats, floats_async):
        np.testing.assert_allclose(asyn, sync, rtol=1e-5, atol=1e-5)
    reasons = {(c[2], type(c[3]).__name__) for c in exact if isinstance(c, tuple)}
    assert {("stop", "str"), ("stop", "int"), ("stop", "NoneType"), ("length", "NoneType")} <= reasons, reasons
    if not kw:
        assert preemptions[True] > 0 and preemptions[False] > 0, preemptions


def test_next_step_is_queued_before_tokens_are_read(folder):
    """The overlap itself: the host waits for step k's tokens only after step k+1
    was scheduled and its model run queued (the last step excepted)."""
    llm = make_llm(folder, True, num_gpu_blocks_override=64)
    DeferredCopyCPU.events.clear()
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 20)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    events = [e for e in DeferredCopyCPU.events]
    total = events.count("run")
    runs = waits = 0
    for e in events:
        if e == "run":
            runs += 1
        elif waits < total - 1:
            assert runs >= waits + 2, f"step {waits}'s tokens were read before step {waits + 1} was queued"
            waits += 1
    assert total >= 12 and waits == total - 1


def test_abort_while_in_flight(folder):
    """Aborting a request whose step is in flight frees it at once; the others
    run on and equal the synchronous run; the aborted one's tokens are a prefix."""
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, size=n).tolist()} for n in (6, 30, 11)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = [o.outputs[0].token_ids for o in make_llm(folder, False).generate(prompts, params, use_tqdm=False)]
    engine = make_llm(folder, True).engine
    ids = [engine.add_request(p, params, stream=True) for p in prompts]
    got: dict[str, list[int]] = {}
    aborted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] = out.outputs[0].token_ids
        if not aborted and len(got.get(ids[1], ())) >= 3:
            engine.abort_request(ids[1])
            aborted = True
            assert ids[1] not in engine.scheduler.requests
    assert aborted
    assert got[ids[0]] == full[0] and got[ids[2]] == full[2]
    assert full[1][:len(got[ids[1]])] == got[ids[1]] and len(got[ids[1]]) < 20
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks


def test_option_defaults_to_the_capability(folder):
    assert make_llm(folder, None).engine.async_scheduling is True
    assert make_llm(folder, None, backend="cpu").engine.async_scheduling is False
    with pytest.raises(ValueError, match=r"async_scheduling=True is not supported by backend 'cpu'.*allowed"):
        make_llm(folder, True, backend="cpu")


def test_conformance_check():
    """The conformance check passes on the deferred-copy backend, is excused by the
    capability on plain CPU, and catches a backend whose copies never land."""
    check = ["async_scheduling_same_tokens"]
    ok = run_conformance(DeferredCopyCPU.name, checks=check)
    assert ok.passed, ok.failures()
    skipped = run_conformance("cpu", checks=check).get(check[0])
    assert skipped.outcome == "skipped" and "async_scheduling" in skipped.excused_by
    broken = run_conformance(NeverCopiedCPU.name, checks=check).get(check[0])
    assert broken.outcome == "failed", broken
