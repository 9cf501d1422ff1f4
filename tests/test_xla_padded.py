"""The TPU attention paths on the CPU PJRT device: a head-size-64 model served through the
padded-head layout (KV cache at 128, same greedy tokens as the CPU backend), a context-sized
block table for the static-shape attention (a 64-token context gathers 64 keys, not
max_model_len), the forward compiled once (no Python re-tracing once warm), and the Pallas
call fed padded q/k/v (the kernel stubbed by torch_xla's non-kernel reference)."""

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed (see .ci/xla.sh)")
os.environ.setdefault("PJRT_DEVICE", "CPU")

from polyrunner import LLM, SamplingParams  # noqa: E402
from polyrunner.attention.static_shape import TOKEN_BLOCK_TABLES  # noqa: E402
from polyrunner.backends.xla import plugin as xla_plugin  # noqa: E402

OPTIONS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=16,
               kv_cache_memory_bytes=1 << 22)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("head64")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engines(folder):
    mp = pytest.MonkeyPatch()
    mp.setenv("POLYRUNNER_XLA_PAD_HEAD", "1")
    mp.setenv("POLYRUNNER_XLA_MIN_CONTEXT", "64")
    try:
        xla = LLM(str(folder), backend="xla", strict_no_recompile=True, request_buckets=[4], **OPTIONS)
    finally:
        mp.undo()
    return xla, LLM(str(folder), backend="cpu", **OPTIONS)


def _run(llm, prompts, n):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_head_64_is_served_through_the_padded_path(engines):
    xla, cpu = engines
    runner = xla.engine.runner
    assert runner.kv_spec.head_size == 64
    assert all(c.shape[-1] == 128 for c in runner.kv_caches)           # padding applied
    assert xla.engine.backend.context_buckets == [4, 8, 16]
    assert runner.executor.warmup_pieces == 2 * 3 + 2 + 4              # (T, C) backbones, selections, sampling
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (5, 17, 40, 90)]
    assert _run(xla, prompts, 10) == _run(cpu, prompts, 10)
    assert runner.executor.serving_graphs == 0


def test_a_64_token_context_gathers_64_keys(engines, monkeypatch):
    """Every step of a request whose context stays within 64 tokens feeds the graph a 4-block
    (64-token) table; one that grows past 64 moves to the 128-token bucket, never max_model_len."""
    xla, cpu = engines
    backend = xla.engine.backend
    widths = []
    extras = backend.host_attention_extras

    def recording(step):
        out = extras(step)
        widths.append((int(step.seq_lens[:step.num_reqs].max()), out[TOKEN_BLOCK_TABLES].shape[1] * 16))
        return out

    monkeypatch.setattr(backend, "host_attention_extras", recording)
    prompt = list(range(3, 43))               # 40 prompt tokens; the 25th output's step reads 64 tokens
    assert _run(xla, [prompt], 25) == _run(cpu, [prompt], 25)
    assert widths and all(ctx == 64 for _, ctx in widths) and max(n for n, _ in widths) == 64
    widths.clear()
    assert _run(xla, [prompt], 30) == _run(cpu, [prompt], 30)
    assert {ctx for n, ctx in widths} == {64, 128} and all(n <= ctx for n, ctx in widths)


def test_forward_is_not_retraced_once_warm(engines, monkeypatch):
    """Compiled once (dynamo, openxla backend): serving replays the bucket's graph without running
    the model's Python, so the attention function is never entered."""
    xla, _ = engines
    assert xla.engine.runner.executor.mode == "dynamo"
    calls = []
    inner = xla_plugin.static_shape_paged_attention
    monkeypatch.setattr(xla_plugin, "static_shape_paged_attention", lambda *a: calls.append(1) or inner(*a))
    _run(xla, [[5, 6, 7, 8]], 6)
    assert calls == []


def test_the_compiled_step_updates_the_cache_in_place(engines, monkeypatch):
    """The static-shape attention's write under dynamo: the cache donated, its device buffer kept
    across steps (see tests/test_xla_pallas_trace.py for the Pallas path)."""
    from test_xla_pallas_trace import buffers_per_step
    xla, _ = engines
    assert xla.engine.runner.executor.mode == "dynamo"
    buffers, seen = buffers_per_step(xla, monkeypatch, [[5, 6, 7, 8, 9]], 4)
    assert seen == [buffers] * 4


def test_pallas_call_gets_padded_heads():
    """`XLABackend.attention` on the Pallas layout with head size 8: the registered op (its CPU kernel
    torch_xla's non-kernel reference, the Pallas kernel needs a TPU) sees q and the cache at 128, the
    output is sliced back to 8 and equals the float64 reference at the real head size's scale."""
    from polyrunner.backends.xla import head_pad, pallas
    from polyrunner.config import EngineConfig, ModelConfig
    from test_xla_buckets import _paged_case
    from test_xla_pallas_reference import nonkernel, registered
    from tolerances import assert_close_ulp, attention_reference

    backend = xla_plugin.XLABackend(EngineConfig(model=ModelConfig()))
    q, k, v, cache, meta, spec, T = _paged_case(4, None)
    want, bound = attention_reference(q, k, v, cache.clone(), meta, spec)
    nb, bs, hkv, d = cache.shape[1:]
    pages = head_pad.pad_heads(torch.stack([cache[0], cache[1]], dim=3).reshape(nb, bs, 2 * hkv, d), 128)
    step = SimpleNamespace(num_reqs=3, num_tokens=T, seq_lens=meta.seq_lens_np,
                           block_tables=meta.block_tables.numpy(), query_start_loc=meta.query_start_loc_np)
    extras = {key: torch.from_numpy(a) for key, a in pallas.host_inputs(step, 8).items()}
    with registered(nonkernel, "CPU") as seen:
        got = backend.attention(q, k, v, pages.contiguous(), dataclasses.replace(meta, extras=extras), spec)
    assert [(qs[-1], kvs[-1]) for qs, kvs in seen] == [(128, 128)] and got.shape[-1] == d
    assert_close_ulp(got[:T], want[:T], torch.float32, ulps=1, abs_err=bound[:T])


def test_an_unseen_backbone_shape_is_compiled_and_refused_in_strict_mode(engines):
    """Skipping guards once warm never replays a wrong graph: a block-table width no bucket has
    (2 blocks) makes dynamo compile anew, which strict mode refuses, naming the backbone.
    (Last user of the shared engine: the refused step leaves it mid-step.)"""
    from polyrunner.backends.xla.executor import RecompilationError
    xla, _ = engines
    xla.engine.backend.force_context_width(2)
    try:
        with pytest.raises(RecompilationError, match="'backbone'"):
            _run(xla, [[5, 6, 7]], 2)
    finally:
        xla.engine.backend.force_context_width(None)
