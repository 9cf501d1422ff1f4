"""CPU graphs (backends/cpu/graphs.py): recorded kernel calls replayed by one C call.

- The recorder and replayer on their own: a replay recomputes from the static
  inputs' current values; torch ops that cannot be replayed fail the capture
  with their name; the arena restarts per capture (graphs share memory).
- The embedded SmolLM2 through the engine, graphs against `enforce_eager`:
  bfloat16 (where the small-M bfloat16 kernels run) and the quantized GGUF path
  (bfloat16 activations, every CPU with the kernel library): the same greedy
  tokens and logprobs exactly, over batch sizes that pad to a capture size,
  contexts across many KV blocks, preemption and prefix-cache hits; decode steps
  replay, prefill steps run eagerly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from polyrunner import LLM, SamplingParams
from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.kernel_calls import REPLAYABLE, NotReplayable

lib = kernels.paged_attention_kernel()
pytestmark = pytest.mark.skipif(lib is None, reason="no CPU kernel library (no C++ compiler?)")


@pytest.fixture
def api():
    from polyrunner.backends.cpu.graphs import CPUGraphAPI
    return CPUGraphAPI(lib)


def test_replay_recomputes_from_the_inputs_current_values(api):
    table = torch.randn(50, 64).to(torch.bfloat16)
    w = torch.rand(64).to(torch.bfloat16) + 0.5
    ids = torch.tensor([3, 7, 7, 41], dtype=torch.int64)

    def forward():
        x = F.embedding(ids, table)                       # a recorded row gather
        h = kernels.rms_norm(x, w, 1e-5)
        return kernels.add_rms_norm(h, x, w, 1e-5)[0]

    replay, out = api.capture(forward, api.pool())
    for new in ([0, 1, 2, 3], [49, 49, 5, 6]):
        ids.copy_(torch.tensor(new))
        replay()
        x = table[ids]
        want = kernels.add_rms_norm(kernels.rms_norm(x, w, 1e-5), x, w, 1e-5)[0]
        assert torch.equal(out, want)


def test_a_capture_computes_nothing_until_replayed(api):
    x = torch.randn(4, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    replay, out = api.capture(lambda: kernels.rms_norm(x, w, 1e-6), api.pool())
    out.fill_(7)
    assert (out == 7).all()                      # the capture only recorded the call
    replay()
    assert torch.equal(out, kernels.rms_norm(x, w, 1e-6))


def test_replay_profile_times_each_recorded_call(api):
    from polyrunner.backends.cpu.graphs import replay_profile
    x = torch.randn(8, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    replay, out = api.capture(lambda: kernels.add_rms_norm(kernels.rms_norm(x, w, 1e-6), x, w, 1e-6)[0],
                              api.pool())
    profile = replay_profile(lib, replay, repeats=3)
    assert [name for name, _, _ in profile] == ["pr_rms_norm", "pr_add_rms_norm"]
    assert all(us > 0 for _, _, us in profile) and profile[0][1][6] == 8   # T (after the dtype), as recorded
    assert torch.equal(out, kernels.add_rms_norm(kernels.rms_norm(x, w, 1e-6), x, w, 1e-6)[0])


@pytest.mark.parametrize("op", ["add", "matmul", "copy"])
def test_unreplayable_torch_ops_fail_the_capture_by_name(api, op):
    x = torch.randn(4, 8)
    fns = {"add": lambda: x + 1, "matmul": lambda: x @ x.T, "copy": lambda: torch.empty(4, 8).copy_(x)}
    names = {"add": "aten.add", "matmul": "aten.mm", "copy": "aten.copy_"}
    with pytest.raises(NotReplayable, match=f"{names[op]}.*cannot be replayed"):
        api.capture(fns[op], api.pool())


def test_a_failed_capture_leaves_no_recording_behind(api):
    x = torch.randn(2, 16).to(torch.bfloat16)
    w = torch.ones(16, dtype=torch.bfloat16)
    with pytest.raises(NotReplayable):
        api.capture(lambda: kernels.rms_norm(x, w, 1e-6) * 2, api.pool())
    replay, out = api.capture(lambda: kernels.rms_norm(x, w, 1e-6), api.pool())
    x.mul_(3)
    replay()
    assert torch.equal(out, kernels.rms_norm(x, w, 1e-6))


def test_arena_restarts_per_capture_and_aligns(api):
    x = torch.randn(3, 64).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)

    def forward():
        a = kernels.rms_norm(x, w, 1e-6)
        return a, kernels.rms_norm(a, w, 1e-6)

    _, (a1, b1) = api.capture(forward, api.pool())
    _, (a2, b2) = api.capture(forward, api.pool())
    assert a1.data_ptr() == a2.data_ptr() and b1.data_ptr() == b2.data_ptr()   # shared memory
    assert a1.data_ptr() % 64 == 0 and b1.data_ptr() % 64 == 0
    assert b1.data_ptr() >= a1.data_ptr() + a1.numel() * a1.element_size()  # no overlap within one


def test_replayer_knows_the_kernels_by_name():
    assert [lib.pr_replay_kernel_name(i + 1).decode() for i in range(len(REPLAYABLE))] == list(REPLAYABLE)
    assert lib.pr_replay_kernel_name(len(REPLAYABLE) + 1) == b""


# ---- the model through the engine ------------------------------------------------------
COMMON = dict(backend="cpu", max_model_len=512, max_num_seqs=8, block_size=16)
PROMPTS = [[3 + (7 * i + 11 * j) % 900 for j in range(5 + 9 * i)] for i in range(7)]


def _run(llm: LLM, prompts, n: int = 40):
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _bf16_graphs_reason() -> str | None:
    if not (kernels.dpbf16_available() or kernels.amx_available() or kernels.avx512_available()):
        return ("no small-M bfloat16 kernel here (AVX512_BF16, AMX or AVX-512F): bfloat16 decode steps use oneDNN, "
                "no graphs")
    return None


@pytest.mark.parametrize("model", ["bfloat16", "quantized", "quantized-float32"])
@pytest.mark.parametrize("sizes", [[7], [5, 3], [1]])
def test_graphs_give_the_eager_tokens_and_logprobs(model, sizes):
    """bfloat16 (packed linears), and the GGUF file quantized with bfloat16 or float32 activations."""
    if model == "bfloat16" and _bf16_graphs_reason():
        pytest.skip(_bf16_graphs_reason())
    kw = dict(COMMON, dtype="float32" if model.endswith("float32") else "bfloat16", kv_cache_memory_bytes=32 << 20)
    if model.startswith("quantized"):
        kw["quantization"] = "gguf"
    graphs, eager = LLM(**kw), LLM(enforce_eager=True, **kw)
    ex = graphs.engine.runner.executor
    assert ex.graph_rows > 0 and ex.num_graphs() > 0 and eager.engine.runner.executor.num_graphs() == 0
    assert graphs.engine.runner.buckets.token_buckets[-1] <= ex.graph_rows
    start = 0
    for n in sizes:    # one batch per size: 7 and 5 pad to the graph of 8, 3 to 4
        batch = PROMPTS[start:start + n]
        start += n
        assert _run(graphs, batch) == _run(eager, batch)
    counts = ex.counters()
    assert counts["replays"] > 30 * len(sizes) and set(counts["eager"]) <= {"mixed"}


def test_graphs_under_preemption_and_prefix_hits():
    """A KV cache too small for every request at once (preemption, recompute) and
    repeated prompts (prefix-cache hits): still the eager tokens."""
    kw = dict(COMMON, dtype="bfloat16", quantization="gguf", num_gpu_blocks_override=24, enable_prefix_caching=True)
    graphs, eager = LLM(**kw), LLM(enforce_eager=True, **kw)
    prompts = PROMPTS[:4] + PROMPTS[:4]
    assert _run(graphs, prompts, 60) == _run(eager, prompts, 60)
    assert graphs.engine.runner.executor.counters()["replays"] > 0
    assert graphs.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("how", ["enforce_eager", "env", "unfused"])
def test_no_graphs_when_turned_off_or_not_replayable(monkeypatch, how):
    kw = dict(COMMON, dtype="float32", quantization="gguf", kv_cache_memory_bytes=16 << 20)
    if how == "enforce_eager":
        kw["enforce_eager"] = True
    elif how == "env":
        monkeypatch.setenv("POLYRUNNER_CPU_GRAPHS", "0")
    else:
        monkeypatch.setenv("POLYRUNNER_CPU_FUSE", "0")   # norms in torch: a step is not all C++ kernels
    llm = LLM(**kw)
    ex = llm.engine.runner.executor
    assert ex.graph_rows == 0 and ex.num_graphs() == 0
    assert not llm.engine.runner.buckets.token_buckets      # and no padding
    assert len(_run(llm, PROMPTS[:2], 4)[0][0]) == 4


def test_capturing_does_not_import_dynamo():
    """Cold start: the capture's dispatch mode must not pull in torch._dynamo (~0.85 s)."""
    import subprocess
    import sys
    code = ("import sys; from polyrunner import LLM; llm = LLM(backend='cpu', max_num_seqs=4, quantization='gguf', "
            "dtype='bfloat16', kv_cache_memory_bytes=16 << 20); assert llm.engine.runner.executor.num_graphs() > 0; "
            "print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_a_kernel_without_a_replay_entry_fails_the_capture(api):
    """Every kernel call made during a capture is either recorded or fails it, never skipped
    (the prefill attention kernel, for one, has no replay entry: graphs hold decode steps)."""
    from test_cpu_prefill_attention import _prefills
    meta = _prefills(np.random.default_rng(0), [20], [0], 16, 8)
    q = torch.zeros(20, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    if not kernels.prefill_attention_bf16(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, out,
                                          0, 1, 0.1, 0):
        pytest.skip("the prefill attention kernel does not run on this CPU (no AVX512_BF16)")
    with pytest.raises(NotReplayable, match="pr_prefill_attention_bf16 has no replay entry"):
        api.capture(lambda: kernels.prefill_attention_bf16(q, cache, meta.query_start_loc, meta.seq_lens,
                                                           meta.block_tables, out, 0, 1, 0.1, 0), api.pool())
