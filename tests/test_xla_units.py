"""XLA backend pieces that need no torch_xla: the head-size padding, the static attention's
context buckets and memory bound, vLLM's TPU page size and the profiled KV budget."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from polyrunner.attention.metadata import LayerSpec
from polyrunner.attention.static_shape import TOKEN_BLOCK_TABLES, static_shape_paged_attention
from polyrunner.backends.xla import head_pad, static_attention
from polyrunner.backends.xla.memory import profiled_kv_budget, tpu_page_size
from polyrunner.plugin_api import KVCacheSpec
from test_xla_buckets import _paged_case
from tolerances import assert_close_ulp, attention_reference


@pytest.mark.parametrize("head,padded", [(64, 128), (8, 128), (128, 128), (96, 128), (192, 256), (256, 256)])
def test_padded_head_size(head, padded):
    assert head_pad.padded_head_size(head) == padded
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=3, head_size=head, dtype=torch.float32)
    assert head_pad.padded_spec(spec).head_size == padded
    assert head_pad.padded_spec(spec).page_size_bytes == spec.page_size_bytes * padded // head


def test_zero_padded_heads_give_the_same_attention():
    """Static-shape attention over q/k/v and a cache padded with zero columns, scale of the real
    head size, sliced back: the float64 reference of the unpadded inputs, to fp32 rounding."""
    q, k, v, cache, meta, spec, T = _paged_case(3, None)
    want, bound = attention_reference(q, k, v, cache.clone(), meta, spec)
    size = head_pad.padded_head_size(q.shape[-1])
    padded_cache = head_pad.pad_heads(cache, size).contiguous()
    out = static_shape_paged_attention(*(head_pad.pad_heads(t, size) for t in (q, k, v)), padded_cache, meta, spec)
    assert out.shape[-1] == size and torch.equal(out[..., q.shape[-1]:], torch.zeros_like(out[..., q.shape[-1]:]))
    assert_close_ulp(out[:T, :, :q.shape[-1]], want[:T], torch.float32, ulps=1, abs_err=bound[:T])
    # the padded size's scale would be wrong: the test can tell
    wrong = static_shape_paged_attention(*(head_pad.pad_heads(t, size) for t in (q, k, v)),
                                         head_pad.pad_heads(cache, size).contiguous(), meta,
                                         LayerSpec(spec.num_heads, spec.num_kv_heads, size, size ** -0.5))
    with pytest.raises(AssertionError):
        assert_close_ulp(wrong[:T, :, :q.shape[-1]], want[:T], torch.float32, ulps=1, abs_err=bound[:T])


@pytest.mark.parametrize("max_len,bs,min_ctx,expected", [
    (512, 16, 64, [4, 8, 16, 32]), (128, 16, 1024, [8]), (8192, 16, 1024, [64, 128, 256, 512]),
    (100, 16, 32, [2, 4, 7]), (64, 16, 64, [4])])
def test_context_buckets(max_len, bs, min_ctx, expected):
    assert static_attention.context_buckets(max_len, bs, min_ctx) == expected


def test_token_tables_are_cut_to_the_context_bucket():
    tables = np.arange(3 * 32, dtype=np.int32).reshape(3, 32) + 1
    step = SimpleNamespace(num_reqs=2, num_tokens=3, seq_lens=np.array([40, 64, 0], np.int32),
                           block_tables=tables, token_to_req=np.array([0, 1, 1, 0], np.int32))
    got = static_attention.token_tables(step, 16, [4, 8, 16, 32])[TOKEN_BLOCK_TABLES]
    assert got.shape == (4, 4)                     # 64 tokens of context: 4 blocks, not 32
    assert (got[:3] == tables[[0, 1, 1], :4]).all() and (got[3] == 0).all()
    step.seq_lens[1] = 65
    assert static_attention.token_tables(step, 16, [4, 8, 16, 32])[TOKEN_BLOCK_TABLES].shape == (4, 8)
    assert static_attention.token_tables(step, 16, [4, 8, 16, 32], width=16)[TOKEN_BLOCK_TABLES].shape == (4, 16)


def test_static_gather_refused_over_the_bound():
    """SmolLM2-135M (3 KV heads, head size 64 padded to 128) at T=2048 over an 8192 context."""
    with pytest.raises(ValueError, match=r"token bucket 2048 x context 8192 x 3 KV heads x head size 128"):
        static_attention.check_gather_fits(2048, 8192, 3, 128, 1 << 30)
    static_attention.check_gather_fits(16, 64, 3, 128, 1 << 30)   # a small one fits


@pytest.mark.parametrize("max_len,page", [(64, 16), (256, 16), (512, 32), (1024, 64), (2048, 128), (3000, 256),
                                          (8192, 256), (8193, 16), (131072, 16)])
def test_tpu_page_size_is_vllms(max_len, page):
    # vLLM PallasAttentionBackend.get_page_size: next_power_of_2(max_model_len) // 16 in [16, 256]; 16 above 8192
    assert tpu_page_size(max_len) == page


def test_kv_budget_is_limit_times_utilisation_minus_the_profiled_peak():
    calls = []
    info = {"bytes_limit": 16 << 30, "bytes_used": 3 << 30, "peak_bytes_used": 5 << 30}
    budget = profiled_kv_budget(lambda: calls.append("info") or info, lambda: calls.append("profile"),
                                lambda: calls.append("wait"), 0.9)
    assert calls == ["profile", "wait", "info"]
    assert budget == int((16 << 30) * 0.9) - (5 << 30)
    del info["peak_bytes_used"]                          # no peak reported: bytes in use after the profile
    assert profiled_kv_budget(lambda: info, lambda: None, lambda: None, 0.9) == int((16 << 30) * 0.9) - (3 << 30)
    info["bytes_used"] = 15 << 30
    assert profiled_kv_budget(lambda: info, lambda: None, lambda: None, 0.9) == 0


@pytest.mark.parametrize("explicit", [None, 16])
def test_tpu_block_size_default(monkeypatch, tiny_model_factory, explicit):
    """With Pallas (a TPU), an unset block size becomes vLLM's TPU page size; a set one is kept."""
    from polyrunner.backends.xla.plugin import XLABackend
    from polyrunner.config import CacheConfig, EngineConfig, ModelConfig
    monkeypatch.setattr(XLABackend, "wants_pallas", classmethod(lambda cls: True))
    cache = CacheConfig() if explicit is None else CacheConfig(block_size=explicit)
    config = EngineConfig(model=ModelConfig(model=str(tiny_model_factory("llama")[0]), max_model_len=512),
                          cache=cache)
    XLABackend.adjust_config(config)
    assert config.cache.block_size == (32 if explicit is None else explicit)
