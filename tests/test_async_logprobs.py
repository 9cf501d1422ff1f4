"""Logprobs keep asynchronous scheduling's overlap: they come back like the sampled
tokens, through `Backend.to_host_async`, and are read when the step's output is read.

The test backend's `to_host_async` hands back a host tensor that holds garbage until
`result()` is called (as a real asynchronous copy does) and records, for every copy,
how many model runs were queued when it started and when it was waited for. Every
`LogprobsTensors.tolists()` must then run on such a host tensor: one on a device
tensor would be a blocking device->host copy in the step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from polyrunner import LLM, SamplingParams
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.device.backend import HostFuture
from polyrunner.plugins import hookimpl, register
from polyrunner.plugins.manager import unregister
from polyrunner.sample.logprobs import LogprobsTensors, gather_logprobs


@dataclasses.dataclass
class Copy:
    dtype: torch.dtype
    runs_at_start: int
    host: torch.Tensor
    runs_at_wait: int | None = None


class RecordingCopyCPU(CPUBackend):
    """CPU with deferred, recorded device->host copies (asynchronous scheduling on)."""

    name = "cpu-recording-copy"
    priority = -100
    capabilities = dataclasses.replace(CPUBackend.capabilities, async_scheduling=True)
    runs = 0
    copies: list[Copy] = []

    def make_executor(self, model):
        executor = super().make_executor(model)
        run = executor.run

        def counted(inputs):
            RecordingCopyCPU.runs += 1
            return run(inputs)
        executor.run = counted
        return executor

    def to_host_async(self, tensor: torch.Tensor) -> HostFuture:
        host = torch.full(tensor.shape, -7, dtype=tensor.dtype)
        record = Copy(tensor.dtype, RecordingCopyCPU.runs, host)
        RecordingCopyCPU.copies.append(record)

        def wait() -> None:
            if record.runs_at_wait is None:
                record.runs_at_wait = RecordingCopyCPU.runs
                host.copy_(tensor)
        return HostFuture(host, wait=wait)


class _Plugin:
    PLUGIN_API_VERSION = "1.0"

    @hookimpl
    def polyrunner_backends(self):
        return [RecordingCopyCPU]


@pytest.fixture(scope="module", autouse=True)
def backend():
    register(_Plugin(), name="test-async-logprobs")
    yield
    unregister("test-async-logprobs")


def _run(folder, asynchronous: bool, monkeypatch) -> tuple[list, list[Copy], list[torch.Tensor]]:
    """Outputs, the copies made, and the tensors each `tolists()` read its logprobs from."""
    llm = LLM(str(folder), backend=RecordingCopyCPU.name, async_scheduling=asynchronous, max_num_seqs=4,
              max_num_batched_tokens=24, num_gpu_blocks_override=40, max_model_len=128)
    assert llm.engine.async_scheduling is asynchronous
    RecordingCopyCPU.runs, RecordingCopyCPU.copies = 0, []
    read: list[torch.Tensor] = []
    tolists = LogprobsTensors.tolists

    def recording(self):
        read.append(self.logprobs)
        return tolists(self)
    monkeypatch.setattr(LogprobsTensors, "tolists", recording)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 200, size=n).tolist()} for n in (5, 30, 9)]
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    return outputs, RecordingCopyCPU.copies, read


def _summary(outputs) -> list:
    out = []
    for o in outputs:
        plp = [None if p is None else {t: (lp.rank, lp.logprob) for t, lp in p.items()}
               for p in (o.prompt_logprobs or [])]
        c = o.outputs[0]
        out.append((plp, c.token_ids, [{t: (lp.rank, lp.logprob) for t, lp in p.items()} for p in c.logprobs or []]))
    return out


def test_logprobs_are_copied_asynchronously_and_read_with_the_output(tiny_model_factory, monkeypatch):
    folder, _ = tiny_model_factory("llama")
    outputs, copies, read = _run(folder, True, monkeypatch)
    total = RecordingCopyCPU.runs
    float_copies = [c for c in copies if c.dtype == torch.float32]
    # sampled logprobs every step with a logprobs row, prompt logprobs while the 30-token prompt is chunked
    assert len(float_copies) >= 8, len(float_copies)
    assert read and all(any(t is c.host for c in float_copies) for t in read), \
        "a LogprobsTensors.tolists() ran on a device tensor (a blocking copy) instead of a to_host_async copy"
    for c in copies:
        assert c.runs_at_wait is not None, "a copy was never waited for"
        if c.runs_at_start < total:   # the last step's copies are waited for with nothing queued after them
            assert c.runs_at_wait > c.runs_at_start, (
                f"a {c.dtype} copy started after run {c.runs_at_start} was waited for before the next step was "
                "queued")
    reference, _, _ = _run(folder, False, monkeypatch)
    got, want = _summary(outputs), _summary(reference)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert got[0][2] and got[1][0] and got[1][2]   # sampled and prompt logprobs came back
    for g, w in zip(got, want):
        for mine, theirs in ((g[0], w[0]), (g[2], w[2])):
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.keys() == b.keys() and all(a[t][0] == b[t][0] for t in a)
                    np.testing.assert_allclose([a[t][1] for t in a], [b[t][1] for t in b], rtol=1e-5, atol=1e-5)


@dataclasses.dataclass
class _Trimmed(LogprobsTensors):
    keep: int = 1

    def tolists(self):
        full = super().tolists()
        return type(full)([r[:self.keep] for r in full.token_ids], [r[:self.keep] for r in full.logprobs],
                           full.ranks)


def test_future_result_equals_tolists_and_keeps_a_subclass_conversion():
    lp = torch.log_softmax(torch.randn(3, 11), dim=-1)
    tensors = gather_logprobs(lp, 4, torch.tensor([1, 5, 9]))
    waited = []

    def copy(t: torch.Tensor) -> HostFuture:
        host = torch.zeros_like(t)
        return HostFuture(host, wait=lambda: (waited.append(1), host.copy_(t)))
    future = tensors.to_host_async(copy)
    assert not waited   # started, not waited for
    assert future.result() == tensors.tolists() and len(waited) == 3
    assert future.result() is future.result() and len(waited) == 3   # waits once
    trimmed = _Trimmed(tensors.token_ids, tensors.logprobs, tensors.ranks, keep=2)
    assert trimmed.to_host_async(copy).result() == trimmed.tolists()
    assert all(len(r) == 2 for r in trimmed.to_host_async(copy).result().token_ids)
