"""The npu backend end to end through the torch_npu test double (tests/npu_double), which refuses
what the real ops refuse: every line of backends/npu runs in CI, as torch_npu documents it.

- greedy tokens equal the CPU backend's in the same dtype (bfloat16 and float16, block size 128)
  for a Llama with chunked prefill and a sliding-window Mistral, with decode graphs replayed,
  except at a near-tie of the CPU run (`assert_tokens_match`); the double's ops (not the SDPA
  fallback) did the work: KV write, decode attention in graphs (paged; the fused op's `.out` for
  the window), fused prefill (TND sparse_mode 3; BSND sparse_mode 4 for the window), RMSNorm
  (+ add), rotary, SwiGLU;
- decode attention reads the context only (a 300-token context: 3 blocks of 128 of the table's 4);
- what the ops refuse is refused at start-up, naming the field (float32, block size 16, head size 24);
  dtype "auto" on a float32 checkpoint runs bfloat16; block size 128 by default;
- FULL graph mode falls back to FULL_DECODE_ONLY.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from npu_double_fixture import npu_double  # noqa: F401 - the fixture
from polyrunner import LLM, SamplingParams
from polyrunner.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig
from polyrunner.plugins import create_backend
from polyrunner.tools.conformance.tiny_llama import write_tiny_llama as conformance_tiny_llama
from test_cuda_backend import write_tiny_llama
from tiny_models import build_tiny_model

KV_BYTES = 32 << 20   # split K/V halves are 2 MiB-aligned per layer
NEAR_TIE = 0.1        # nats: about two bfloat16 steps of a logit near 8
OPS = ("_npu_reshape_and_cache", "npu_fused_infer_attention_score", "npu_rms_norm", "npu_add_rms_norm",
       "npu_rotary_mul", "npu_swiglu")


def prompts(seed: int, n: int, lo: int, hi: int) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 500, size=int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


def generate(folder, backend: str, prompt_list, max_tokens: int, dtype: str, logprobs: int | None = None,
             **options):
    """(llm, outputs): greedy completions on `backend`; `logprobs` top logprobs per token."""
    llm = LLM(str(folder), backend=backend, dtype=dtype, max_num_seqs=4, kv_cache_memory_bytes=KV_BYTES, **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return llm, [o.outputs[0] for o in llm.generate(prompt_list, params, use_tqdm=False)]


def assert_tokens_match(got, ref) -> None:
    """Greedy tokens `got` equal the reference run's (`ref`, with top logprobs) token for token, except
    that a prompt may diverge where the reference's top two tokens are within NEAR_TIE nats (a
    low-precision rounding picks either) and is compared no further; at most half of them may."""
    diverged = 0
    for i, (g, r) in enumerate(zip(got, ref)):
        a, b = list(g.token_ids), list(r.token_ids)
        assert len(a) == len(b), (i, a, b)
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            continue
        top = r.logprobs[at]
        gap = top[b[at]].logprob - top[a[at]].logprob if a[at] in top else float("inf")
        assert gap < NEAR_TIE, f"prompt {i}: token {at} is {a[at]}, the CPU backend's {b[at]} by {gap:.3f} nats"
        diverged += 1
    assert diverged <= len(got) // 2, f"{diverged} of {len(got)} prompts diverged at near-ties"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Llama and sliding-window Mistral (head size 16), built before the double is imported."""
    root = tmp_path_factory.mktemp("npu_models")
    build_tiny_model("mistral", root / "mistral")
    return {"llama": write_tiny_llama(root / "llama"), "mistral": root / "mistral"}


@pytest.fixture
def no_sdpa(monkeypatch):
    """The core's SDPA attention must not run on the npu backend."""
    def refuse(*args, **kwargs):
        raise AssertionError("the SDPA fallback ran on the npu backend")
    monkeypatch.setattr("polyrunner.backends.npu.attention.sdpa_paged_attention", refuse)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_tokens_match_cpu_through_the_double(models, npu_double, no_sdpa, kind, dtype):  # noqa: F811
    """Chunked prefill (64-token steps, prompts of 100-300 tokens over blocks of 128; Mistral's window
    is 48), decode graphs."""
    folder = models[kind]
    batch = prompts(1, 5, 100, 300)
    _, want = generate(folder, "cpu", batch, 8, dtype, logprobs=5, block_size=128, max_num_batched_tokens=64)
    llm, got = generate(folder, "npu", batch, 8, dtype, max_num_batched_tokens=64)
    assert llm.engine.config.cache.block_size == 128
    assert_tokens_match(got, want)
    calls, replays = npu_double.CALLS, npu_double.REPLAYS
    decode_op = "npu_fused_infer_attention_score.out" if kind == "mistral" else "_npu_paged_attention"  # the window
    assert all(calls[op] > 0 for op in OPS + (decode_op,)), dict(calls)
    counters = llm.engine.runner.executor.counters()
    assert counters["replays"] > 0 and replays[decode_op] == 2 * counters["replays"]  # 2 layers per replay
    assert all(replays[op] > 0 for op in ("_npu_reshape_and_cache", "npu_rms_norm", "npu_add_rms_norm",
                                          "npu_rotary_mul", "npu_swiglu")), dict(replays)
    fia = npu_double.LAST["npu_fused_infer_attention_score"]
    assert (fia["input_layout"], fia["sparse_mode"]) == (("BSND", 4) if kind == "mistral" else ("TND", 3))
    if kind == "mistral":
        assert fia["pre_tokens"] == 47 and fia["next_tokens"] == 0
        assert npu_double.LAST[decode_op]["workspace"] is not None


def test_decode_attention_is_context_sized(models, npu_double):  # noqa: F811
    """A 300-token context (max_model_len 512, block size 128): the paged-attention op gets 300 as the
    context length and reads 3 blocks (not 4), in graph replays and eagerly."""
    folder = models["llama"]
    prompt = prompts(2, 1, 296, 297)
    for eager in (False, True):
        npu_double.reset_counters()
        generate(folder, "npu", prompt, 5, "bfloat16", max_model_len=512, enforce_eager=eager)  # last: 300
        last = npu_double.LAST["_npu_paged_attention"]
        assert last["context_lens"].tolist() == [300] and last["blocks_read"] == 3
        assert (npu_double.REPLAYS["_npu_paged_attention"] > 0) != eager
        # eagerly the table is cut to the context; a graph's table is static (512 / 128 columns), read to 300
        assert tuple(last["block_table"].shape) == ((1, 3) if eager else (1, 4))
        assert (last["workspace"] is None) == eager   # a graph's task runs with the workspace sized at capture


def test_refusals_name_the_field_at_start_up(models, npu_double, tmp_path):  # noqa: F811
    folder = models["llama"]
    common = dict(backend="npu", max_num_seqs=2, kv_cache_memory_bytes=KV_BYTES, enforce_eager=True)
    heads_of_24 = conformance_tiny_llama(tmp_path / "d24", hidden_size=96, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"head_size=24 is not supported by backend 'npu'.*multiples of 16 up to 256"):
        LLM(str(heads_of_24), dtype="bfloat16", **common)
    with pytest.raises(ValueError, match=r"dtype=float32 is not supported by backend 'npu'.*allowed: bfloat16, "
                                         r"float16"):
        LLM(str(folder), dtype="float32", **common)
    with pytest.raises(ValueError, match=r"block_size=16 is not supported by backend 'npu'.*allowed: 128, 256, "
                                         r"384, 512"):
        LLM(str(folder), dtype="bfloat16", block_size=16, **common)
    for options, want in (({}, 128), ({"block_size": 256}, 256)):
        llm = LLM(str(folder), **common, **options)   # dtype auto: a float32 checkpoint runs bfloat16
        assert llm.engine.config.cache.block_size == want and llm.engine.runner.kv_spec.dtype == torch.bfloat16
    cpu = LLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=2, kv_cache_memory_bytes=8 << 20)
    assert cpu.engine.config.cache.block_size == 16


def test_kv_budget_from_the_doubles_memory_statistics(models, npu_double):  # noqa: F811
    """Without kv_cache_memory_bytes the KV budget is total x utilisation minus what is live and the
    profile's peak: a profile that peaks 64 MiB higher, or 64 MiB more held, leaves 64 MiB less."""
    gc.collect()   # an earlier engine's KV cache is live memory of the (emulated) device
    llm = LLM(str(models["llama"]), backend="npu", max_num_seqs=2, enforce_eager=True, gpu_memory_utilization=0.2)
    runner, total, mib = llm.engine.runner, torch.npu.mem_get_info()[1], 1 << 20
    assert 0 < runner.num_blocks * runner.kv_spec.page_size_bytes <= total * 0.2
    del llm, runner
    gc.collect()
    backend = create_backend(EngineConfig(model=ModelConfig(model=str(models["llama"])), runner=RunnerConfig(
        backend="npu"), cache=CacheConfig(memory_utilization=0.2)))

    def profile(peak_mib: int) -> None:
        torch.ones(peak_mib * mib, dtype=torch.uint8).sum()   # a temporary, freed before the profile ends

    base = backend.kv_cache_budget(0, lambda: profile(1))
    assert base - backend.kv_cache_budget(0, lambda: profile(65)) >= 63 * mib
    held = torch.ones(64 * mib, dtype=torch.uint8)
    assert base - backend.kv_cache_budget(0, lambda: profile(1)) >= 63 * mib
    del held


def test_full_graph_mode_falls_back_to_decode_only():
    """Mixed graphs would freeze the prefill op's host lengths: FULL runs as FULL_DECODE_ONLY, said why."""
    from polyrunner.backends.npu.graph import ACLGraphExecutor
    from polyrunner.device.graphs import FULL, FULL_DECODE_ONLY, GraphAPI
    ex = ACLGraphExecutor(torch.nn.Identity(), GraphAPI(), max_num_seqs=4, length_adaptive=True, mode=FULL)
    assert ex.mode == FULL_DECODE_ONLY and "host sequence lengths" in (ex.fallback_reason or "")
    assert ACLGraphExecutor(torch.nn.Identity(), GraphAPI(), max_num_seqs=4, length_adaptive=True,
                            mode=FULL_DECODE_ONLY).fallback_reason is None
