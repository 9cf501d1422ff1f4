"""The npu backend end to end through the torch_npu test double (tests/npu_double): every line of
backends/npu runs in CI, its torch_npu calls checked against their documented signatures.

- tokens equal the CPU backend's (float32, greedy) for a Llama with chunked prefill and a
  sliding-window Mistral, with decode graphs replayed, and the double's ops (not the SDPA
  fallback) did the work: KV write, decode attention in graphs (paged; the fused op for the
  window), fused prefill, RMSNorm (+ add), rotary, SwiGLU;
- decode attention reads the context only (a 64-token context: 64 context lengths, 4 blocks of 16);
- the double's graph is faithful: a captured op keeps its host lengths unless updated;
- block size 128 by default on NPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from npu_double_fixture import npu_double  # noqa: F401 - the fixture
from polyrunner import LLM, SamplingParams
from test_cuda_backend import write_tiny_llama
from tiny_models import build_tiny_model

KV_BYTES = 32 << 20   # split K/V halves are 2 MiB-aligned per layer
OPS = ("_npu_reshape_and_cache", "_npu_paged_attention", "npu_fused_infer_attention_score", "npu_rms_norm",
       "npu_add_rms_norm", "npu_rotary_mul", "npu_swiglu")


def _prompts(seed: int, n: int, lo: int, hi: int) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 500, size=int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


def _generate(folder, backend: str, prompts, max_tokens: int, **options):
    llm = LLM(str(folder), backend=backend, dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=KV_BYTES,
              **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Llama and sliding-window Mistral, built before the double is imported."""
    root = tmp_path_factory.mktemp("npu_models")
    build_tiny_model("mistral", root / "mistral")
    return {"llama": write_tiny_llama(root / "llama"), "mistral": root / "mistral"}


@pytest.fixture
def no_sdpa(monkeypatch):
    """The core's SDPA attention must not run on the npu backend."""
    def refuse(*args, **kwargs):
        raise AssertionError("the SDPA fallback ran on the npu backend")
    monkeypatch.setattr("polyrunner.backends.npu.attention.sdpa_paged_attention", refuse)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_tokens_match_cpu_through_the_double(models, npu_double, no_sdpa, kind):  # noqa: F811
    """Chunked prefill (32-token steps, prompts up to 90 tokens; Mistral's window is 48), decode graphs."""
    folder = models[kind]
    prompts = _prompts(1, 5, 20, 90)
    _, want = _generate(folder, "cpu", prompts, 8, block_size=16, max_num_batched_tokens=32)
    llm, got = _generate(folder, "npu", prompts, 8, block_size=16, max_num_batched_tokens=32)
    assert got == want
    calls, replays = npu_double.CALLS, npu_double.REPLAYS
    decode_op = "npu_fused_infer_attention_score" if kind == "mistral" else "_npu_paged_attention"  # the window
    assert all(calls[op] > 0 for op in OPS if op != "_npu_paged_attention" or kind == "llama"), dict(calls)
    counters = llm.engine.runner.executor.counters()
    assert counters["replays"] > 0 and replays[decode_op] == 2 * counters["replays"]  # 2 layers per replay
    assert all(replays[op] > 0 for op in ("_npu_reshape_and_cache", "npu_rms_norm", "npu_add_rms_norm",
                                          "npu_rotary_mul", "npu_swiglu")), dict(replays)
    fia = npu_double.LAST["npu_fused_infer_attention_score"]
    assert fia["sparse_mode"] == (4 if kind == "mistral" else 3)
    if kind == "mistral":
        assert fia["pre_tokens"] == 47 and fia["next_tokens"] == 0


def test_decode_attention_is_context_sized(models, npu_double):  # noqa: F811
    """A 64-token context (max_model_len 512, block size 16): the paged-attention op gets 64 as the
    context length and reads 4 blocks (not 32), in graph replays and eagerly."""
    folder = models["llama"]
    prompt = _prompts(2, 1, 60, 61)
    for eager in (False, True):
        npu_double.reset_counters()
        _generate(folder, "npu", prompt, 5, block_size=16, max_model_len=512, enforce_eager=eager)  # last: 64
        last = npu_double.LAST["_npu_paged_attention"]
        assert last["context_lens"].tolist() == [64] and last["blocks_read"] == 4
        assert (npu_double.REPLAYS["_npu_paged_attention"] > 0) != eager
        # eagerly the table is cut to the context; a graph's table is static (512 / 16 columns), read to 64
        assert tuple(last["block_table"].shape) == ((1, 4) if eager else (1, 32))


def test_graph_keeps_captured_host_lengths_unless_updated(npu_double):  # noqa: F811
    """The double's replay re-executes the capture with the host lengths it froze: without the
    task update a longer context is ignored (so the backend's update is what the tokens test checks)."""
    tnpu = npu_double
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(4, 16, 1, 8, generator=g), torch.randn(4, 16, 1, 8, generator=g)
    q, out = torch.randn(1, 2, 8, generator=g), torch.zeros(1, 2, 8)
    table = torch.tensor([[1, 2]], dtype=torch.int32)

    def attend(lens: int) -> dict:
        return dict(query=q, key_cache=kc, value_cache=vc, num_kv_heads=1, num_heads=2, scale_value=0.35,
                    block_table=table, context_lens=torch.tensor([lens], dtype=torch.int32), out=out)

    expected = {}
    for n in (10, 30):
        tnpu._npu_paged_attention(**attend(n))
        expected[n] = out.clone()
    graph, stream = torch.npu.NPUGraph(), torch.npu.current_stream()
    with torch.npu.graph(graph):
        torch.npu.graph_task_group_begin(stream)
        tnpu._npu_paged_attention(**attend(10))
        handle = torch.npu.graph_task_group_end(stream)
    out.zero_()
    graph.replay()
    assert torch.equal(out, expected[10])
    torch.npu.graph_task_update_begin(stream, handle)
    tnpu._npu_paged_attention(**attend(30))
    torch.npu.graph_task_update_end(stream)
    graph.replay()
    assert torch.equal(out, expected[30])
    with pytest.raises(TypeError):   # the documented signature is enforced
        tnpu._npu_paged_attention(**attend(30), scale=1.0)


def test_block_size_128_by_default(models, npu_double):  # noqa: F811
    folder = models["llama"]
    for options, want in (({}, 128), ({"block_size": 32}, 32)):
        llm = LLM(str(folder), backend="npu", dtype="float32", max_num_seqs=2, kv_cache_memory_bytes=KV_BYTES,
                  enforce_eager=True, **options)
        assert llm.engine.config.cache.block_size == want
    cpu = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=2, kv_cache_memory_bytes=8 << 20)
    assert cpu.engine.config.cache.block_size == 16


def test_full_graph_mode_falls_back_to_decode_only():
    """Mixed graphs would freeze the prefill op's host lengths: FULL runs as FULL_DECODE_ONLY, said why."""
    from polyrunner.backends.npu.graph import ACLGraphExecutor
    from polyrunner.device.graphs import FULL, FULL_DECODE_ONLY, GraphAPI
    ex = ACLGraphExecutor(torch.nn.Identity(), GraphAPI(), max_num_seqs=4, length_adaptive=True, mode=FULL)
    assert ex.mode == FULL_DECODE_ONLY and "host sequence lengths" in (ex.fallback_reason or "")
    assert ACLGraphExecutor(torch.nn.Identity(), GraphAPI(), max_num_seqs=4, length_adaptive=True,
                            mode=FULL_DECODE_ONLY).fallback_reason is None
