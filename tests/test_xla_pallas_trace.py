"""The TPU's Pallas attention path compiled on the CPU PJRT device, as vLLM runs it on a TPU.

The engine takes the Pallas path (`XLABackend.wants_pallas` forced) and the kernel body of the
registered op `torch.ops.xla.ragged_paged_attention` is replaced, for the XLA dispatch key only, by
a fixed-shape CPU reference (`test_xla_pallas_reference.ragged_reference`): the compiled step is the
TPU trace with the kernel body swapped. Checked, under dynamo (the default): the graph of every
backbone bucket calls the registered attention op, the KV update op and the buffer-donation op once
per layer; no graph break; no dynamo trace and no XLA compilation after warm-up (strict mode);
serving never re-enters the kernel body (the cached graph replays). In both modes (dynamo and the
lazy trace): each layer's KV cache keeps its device buffer across steps (updated in place), an eager
run of the model left pending before a step does not break it, greedy tokens equal the CPU
backend's."""

from __future__ import annotations

import contextlib
import os
from collections import Counter

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed (see .ci/xla.sh)")
os.environ.setdefault("PJRT_DEVICE", "CPU")

from polyrunner import LLM, SamplingParams  # noqa: E402
from polyrunner.backends.xla import kv_update  # noqa: E402
from polyrunner.backends.xla.plugin import XLABackend  # noqa: E402
from test_xla_pallas_reference import ragged_reference, registered  # noqa: E402

OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=16,
               kv_cache_memory_bytes=1 << 22)
ATTENTION, KV_UPDATE, DONATE = ("xla.ragged_paged_attention", "polyrunner_xla.kv_cache_update",
                                "xla.dynamo_set_buffer_donor_")


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("llama")[0]


@pytest.fixture(scope="module")
def cpu(folder):
    return LLM(str(folder), backend="cpu", **OPTIONS)


@pytest.fixture(scope="module", params=["dynamo", "trace"])
def pallas(request, folder, cpu):
    """(the XLA engine on the Pallas path, in the default dynamo mode or the lazy trace, the CPU
    engine, the kernel body's calls); dynamo's graph-break counter is reset before the XLA engine."""
    from torch._dynamo.utils import counters
    mp = pytest.MonkeyPatch()
    mp.setattr(XLABackend, "wants_pallas", classmethod(lambda cls: True))
    mp.setenv("POLYRUNNER_XLA_DYNAMO", "1" if request.param == "dynamo" else "0")
    with contextlib.ExitStack() as stack:
        stack.callback(mp.undo)
        calls = stack.enter_context(registered(ragged_reference, "XLA"))
        counters["graph_break"].clear()
        xla = LLM(str(folder), backend="xla", strict_no_recompile=True, request_buckets=[8], **OPTIONS)
        assert xla.engine.runner.executor.mode == request.param
        yield xla, cpu, calls


def _run(llm, prompts, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _op_count(trace: Counter[str], name: str) -> int:
    return sum(n for target, n in trace.items() if target.startswith(name))


def test_every_backbone_graph_holds_the_registered_ops(pallas):
    xla, _, calls = pallas
    backend, ex = xla.engine.backend, xla.engine.runner.executor
    if ex.mode == "trace":
        pytest.skip("no dynamo graph: the lazy trace calls the same ops (`pallas.attention`) every step")
    assert backend.use_pallas and ex.warm
    assert xla.engine.runner.buckets.token_buckets == [16, 32]
    assert all(c.shape[-2:] == (4, 128) for c in xla.engine.runner.kv_caches)   # [.., 2 x 2 KV heads, 128]
    # one dynamo graph per token bucket (+ the warm-up's replay of the first: none, the guards hold)
    assert len(ex.traces) == 2
    for trace in ex.traces:   # once per layer (2)
        assert [_op_count(trace, op) for op in (ATTENTION, KV_UPDATE, DONATE)] == [2, 2, 2], trace
    # the openxla bridge ran the op's XLA body (lazily, while lowering) for each layer and bucket
    assert {c[0] for c in calls} == {(16, 4, 128), (32, 4, 128)} and len(calls) % (2 * 2) == 0
    from torch._dynamo.utils import counters
    assert sum(counters["graph_break"].values()) == 0


def test_serving_replays_without_tracing_or_compiling(pallas):
    """Greedy tokens equal the CPU backend's; strict mode raises on any XLA compilation; dynamo
    traces nothing new and the kernel body is never entered (the cached graph replays), where the
    lazy trace enters it on every step (inside the capture guard)."""
    xla, cpu, calls = pallas
    ex = xla.engine.runner.executor
    traces, body_calls, graphs = len(ex.traces), len(calls), ex.num_graphs()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (3, 17, 30, 9, 45)]   # chunked prefills too
    assert _run(xla, prompts, 12) == _run(cpu, prompts, 12)
    assert ex.serving_graphs == 0 and ex.num_graphs() == graphs
    assert len(ex.traces) == traces
    assert len(calls) == body_calls if ex.mode == "dynamo" else len(calls) > body_calls
    from torch._dynamo.utils import counters
    assert sum(counters["graph_break"].values()) == 0


def buffers_per_step(llm, monkeypatch, prompts, n) -> tuple[list[int], list[list[int]]]:
    """(the caches' device buffers before, and after each step) while `llm` serves `prompts`; the
    steps must write the caches (checked)."""
    runner, backend, ex = llm.engine.runner, llm.engine.backend, llm.engine.runner.executor
    caches = list(runner.kv_caches)
    backend.synchronize()
    buffers = [torch_xla._XLAC._unsafe_buffer_pointer(c) for c in caches]
    before = [c.cpu() for c in caches]
    seen, run = [], ex.run

    def recording(inputs):
        hidden = run(inputs)
        backend.synchronize()
        seen.append([torch_xla._XLAC._unsafe_buffer_pointer(c) for c in inputs.kv_caches])
        return hidden

    monkeypatch.setattr(ex, "run", recording)
    _run(llm, prompts, n)
    monkeypatch.undo()
    assert all(a is b for a, b in zip(runner.kv_caches, caches))
    assert all(not torch.equal(b, c.cpu()) for b, c in zip(before, caches))
    return buffers, seen


def test_kv_cache_is_updated_in_place(pallas, monkeypatch):
    """After every step, each layer's cache is the same tensor holding the same device buffer, and
    the steps wrote into it: donated and aliased, not copied (an undonated cache gets a new buffer
    each step: `test_the_buffer_check_sees_a_copy`)."""
    buffers, seen = buffers_per_step(pallas[0], monkeypatch, [[5, 6, 7, 8, 9], list(range(10, 30))], 5)
    assert seen == [buffers] * 5


def test_the_buffer_check_sees_a_copy():
    """The same check on one compiled write: `kv_update.update_kv_cache` keeps the buffer, the plain
    `index_copy_` of an undonated input (the code before the donation) gets a new buffer each step."""
    dev = torch_xla.device()

    def donated(cache, kv, slots):
        kv_update.update_kv_cache(cache, kv, slots)
        return cache.sum()

    def copied(cache, kv, slots):
        cache.index_copy_(0, slots, kv)
        return cache.sum()

    import torch_xla.core.xla_model as xm
    kept = {}
    for fn in (donated, copied):
        cache = torch.zeros(32, 2, 8).to(dev)
        step = torch.compile(fn, backend="openxla", fullgraph=True, dynamic=False)
        pointers = []
        for i in range(3):
            step(cache, torch.full((2, 2, 8), i + 1.0).to(dev), torch.tensor([i, 10 + i]).to(dev))
            torch_xla.sync()
            xm.wait_device_ops()
            pointers.append(torch_xla._XLAC._unsafe_buffer_pointer(cache))
        assert cache.cpu()[[0, 1, 2, 10, 11, 12], 0, 0].tolist() == [1, 2, 3, 1, 2, 3]
        kept[fn.__name__] = len(set(pointers)) == 1
    assert kept == {"donated": True, "copied": False}


def test_an_eager_run_before_a_step_keeps_the_cache(pallas, monkeypatch):
    """Before each compiled step the model runs eagerly (lazily) on the same inputs and its output is
    kept, still pending, as the conformance suite's reference run leaves it: the executor runs that
    work before the step consumes the caches' donated buffers (otherwise: "buffer ... is deleted" at
    the sync). The eager run writes the same slots with the same values, so the tokens stay the CPU
    backend's."""
    xla, cpu, _ = pallas
    ex, model = xla.engine.runner.executor, xla.engine.runner.model
    run, eager = ex.run, []

    def eager_first(inputs):
        with xla.engine.backend.no_grad():
            eager.append(model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches))
        return run(inputs)

    monkeypatch.setattr(ex, "run", eager_first)
    monkeypatch.setattr(ex, "strict", False)   # the eager run's own graph compiles at the step's sync
    monkeypatch.setattr(ex, "serving_graphs", ex.serving_graphs)   # restored afterwards
    prompts = [[5, 6, 7, 8, 9], list(range(10, 30))]
    assert _run(xla, prompts, 4) == _run(cpu, prompts, 4) and len(eager) == 4
