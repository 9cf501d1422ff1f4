"""XLA backend pieces that need no torch_xla: buckets, the probe without
torch_xla, the static-shape attention and the static sampling functions
(plain torch on the CPU)."""

import importlib.util
import math

import numpy as np
import pytest
import torch

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.static_shape import TOKEN_BLOCK_TABLES, static_shape_paged_attention
from polyrunner.backends.xla import sampling as xs
from polyrunner.backends.xla.buckets import request_buckets, token_buckets, xla_bucket_policy
from polyrunner.backends.xla.executor import select_buckets
from polyrunner.config import EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from tolerances import assert_close_ulp, assert_detects_errors, attention_reference

HAS_XLA = importlib.util.find_spec("torch_xla") is not None


# ---- buckets ------------------------------------------------------------------------
@pytest.mark.parametrize("min_t,max_t,gap,expected", [
    (16, 8192, 0, [16 << i for i in range(10)]),
    (16, 128, 0, [16, 32, 64, 128]),
    (16, 100, 0, [16, 32, 64, 100]),
    (16, 512, 64, [16, 32, 64] + list(range(128, 513, 64))),
    (16, 512, 8, list(range(16, 513, 8))),
    (16, 16, 0, [16]),
    (16, 8, 0, [16]),
])
def test_token_buckets(min_t, max_t, gap, expected):
    assert token_buckets(max_t, min_t, gap) == expected


def test_token_buckets_need_power_of_two_min():
    with pytest.raises(ValueError, match="power of two"):
        token_buckets(512, 24)


@pytest.mark.parametrize("max_seqs,limit,expected", [
    (256, None, [8, 16, 32, 64, 128, 256]),
    (100, None, [8, 16, 32, 64, 100]),
    (8, None, [8]),
    (5, None, [5]),
    (256, 64, [8, 16, 32, 64]),
])
def test_request_buckets(max_seqs, limit, expected):
    assert request_buckets(max_seqs, limit) == expected


@pytest.mark.parametrize("tokens,reqs", [(1, 1), (16, 8), (17, 9), (100, 64), (300, 100), (512, 100)])
def test_policy_covers_every_legal_batch(tokens, reqs):
    cfg = EngineConfig(model=ModelConfig(), scheduler=SchedulerConfig(max_num_seqs=100, max_num_batched_tokens=512))
    policy = xla_bucket_policy(cfg)
    T_pad, R_pad = policy.pad(tokens, min(reqs, tokens))
    assert T_pad >= tokens and R_pad >= min(reqs, tokens)
    assert T_pad in policy.token_buckets and R_pad in policy.request_buckets


def test_policy_sources(monkeypatch):
    sched = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=256)
    cfg = EngineConfig(model=ModelConfig(), scheduler=sched)
    monkeypatch.setenv("POLYRUNNER_XLA_BUCKET_GAP", "64")
    assert xla_bucket_policy(cfg).token_buckets == [16, 32, 64, 128, 192, 256]
    monkeypatch.setenv("POLYRUNNER_XLA_TOKEN_BUCKETS", "64,256,128")
    monkeypatch.setenv("POLYRUNNER_XLA_REQUEST_BUCKETS", "4,32")
    p = xla_bucket_policy(cfg)
    assert (p.token_buckets, p.request_buckets) == ([64, 128, 256], [4, 32])
    cfg = EngineConfig(model=ModelConfig(), scheduler=sched,
                       runner=RunnerConfig(token_buckets=[256], request_buckets=[16]))
    p = xla_bucket_policy(cfg)  # explicit config wins over the environment
    assert (p.token_buckets, p.request_buckets) == ([256], [16])


@pytest.mark.parametrize("max_model_len", [None, 32768])
def test_pallas_request_cap_uses_the_engines_max_model_len(monkeypatch, tmp_path, max_model_len):
    """Pallas's SMEM cap on requests follows the length the engine will run with: the option, else
    the model's max_position_embeddings (a 128k-context model), known before the model loads."""
    from polyrunner.backends.xla import pallas
    from polyrunner.backends.xla.plugin import XLABackend
    from polyrunner.tools.conformance.tiny_llama import write_tiny_llama
    folder = write_tiny_llama(tmp_path / "m", max_position_embeddings=131072)
    monkeypatch.setattr(XLABackend, "wants_pallas", classmethod(lambda cls: True))
    cfg = EngineConfig(model=ModelConfig(model=str(folder), max_model_len=max_model_len),
                       scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048))
    cap = pallas.max_num_seqs(max_model_len or 131072, cfg.cache.block_size)
    assert cap < 256
    assert XLABackend.policy_for(cfg).request_buckets[-1] == cap


def test_policy_must_cover_the_token_budget():
    cfg = EngineConfig(model=ModelConfig(), scheduler=SchedulerConfig(max_num_batched_tokens=256),
                       runner=RunnerConfig(token_buckets=[16, 128]))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        xla_bucket_policy(cfg)


def test_strict_from_env(monkeypatch):
    from polyrunner.backends.xla.executor import strict_from_env
    monkeypatch.delenv("POLYRUNNER_XLA_STRICT", raising=False)
    assert not strict_from_env()
    monkeypatch.setenv("POLYRUNNER_XLA_STRICT", "1")
    assert strict_from_env()
    monkeypatch.setenv("POLYRUNNER_XLA_STRICT", "0")
    assert not strict_from_env()


def test_select_buckets():
    assert select_buckets(16, [8, 16, 32]) == [8, 16]
    assert select_buckets(64, [8, 16, 32]) == [8, 16, 32]
    assert select_buckets(8, [8, 16, 32]) == [8]


# ---- probe --------------------------------------------------------------------------
@pytest.mark.skipif(HAS_XLA, reason="torch_xla is installed here")
def test_probe_without_torch_xla():
    from polyrunner.plugins import list_backends, select_backend
    info = {i.name: i for i in list_backends()}["xla"]
    assert not info.availability.available
    assert info.availability.reason == "torch_xla is not installed"
    with pytest.raises(RuntimeError, match="torch_xla is not installed"):
        select_backend("xla")


def test_plugin_module_does_not_import_torch_xla():
    import subprocess
    import sys
    code = ("import sys, polyrunner.backends.xla.plugin, polyrunner.backends.xla.executor, "
            "polyrunner.backends.xla.pallas; print('torch_xla' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- static-shape attention (plain torch) ------------------------------------------
def _paged_case(seed: int, window: int | None):
    """A padded batch of 3 requests (decode, short prefill, chunked prefill) over a shared pool."""
    g = torch.Generator().manual_seed(seed)
    bs, Hq, Hkv, D, nb, max_blocks = 4, 4, 2, 8, 16, 5
    ctx = [9, 3, 14]       # seq_len after this step
    new = [1, 3, 5]        # query tokens this step
    tables = np.zeros((4, max_blocks), np.int32)  # R_pad = 4
    perm = np.random.default_rng(seed).permutation(np.arange(1, nb))
    used = 0
    for r, L in enumerate(ctx):
        n = -(-L // bs)
        tables[r, :n] = perm[used:used + n]
        used += n
    T, T_pad = sum(new), 16
    qsl = np.array([0, 1, 4, 9, 9], np.int32)
    pos = np.zeros(T_pad, np.int64)
    tok_req = np.zeros(T_pad, np.int32)
    slots = np.zeros(T_pad, np.int64)
    t = 0
    for r in range(3):
        for i in range(new[r]):
            p = ctx[r] - new[r] + i
            pos[t], tok_req[t] = p, r
            slots[t] = tables[r, p // bs] * bs + p % bs
            t += 1
    cache = torch.randn(2, nb, bs, Hkv, D, generator=g)
    cache[:, 0] = 0
    q = torch.randn(T_pad, Hq, D, generator=g)
    k = torch.randn(T_pad, Hkv, D, generator=g)
    v = torch.randn(T_pad, Hkv, D, generator=g)
    seq_lens = np.array(ctx + [0], np.int32)
    meta = AttentionMetadata(
        num_actual_tokens=T, num_reqs=3, num_decodes=1, max_query_len=5, max_seq_len=14,
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        block_tables=torch.from_numpy(tables), slot_mapping=torch.from_numpy(slots),
        positions=torch.from_numpy(pos), token_to_req=torch.from_numpy(tok_req),
        query_start_loc_np=qsl, seq_lens_np=seq_lens)
    spec = LayerSpec(Hq, Hkv, D, D ** -0.5, window)
    return q, k, v, cache, meta, spec, T


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("host_tables", [False, True])
def test_static_attention_matches_reference(window, host_tables):
    q, k, v, cache, meta, spec, T = _paged_case(0, window)
    expected, bound = attention_reference(q, k, v, cache, meta, spec)   # float64, and fp32 math's bound
    if host_tables:
        tables = meta.block_tables.numpy()[meta.token_to_req.numpy()]
        tables[T:] = 0
        meta.extras[TOKEN_BLOCK_TABLES] = torch.from_numpy(tables)
    out = static_shape_paged_attention(q, k, v, cache, meta, spec)
    assert_detects_errors(lambda o: assert_close_ulp(o, expected[:T], ulps=1, abs_err=bound[:T]), out[:T])
    assert torch.isfinite(out).all()


# ---- static sampling functions -----------------------------------------------------
def test_noise_is_a_function_of_key_and_token():
    keys = torch.tensor([0, 1, 12345, (1 << 32) - 1])
    a, b = xs.exponential_noise(keys, 1000), xs.exponential_noise(keys, 1000)
    assert torch.equal(a, b) and (a > 0).all() and torch.isfinite(a).all()
    assert abs(a.mean().item() - 1.0) < 0.05 and not torch.equal(a[0], a[1])
    # Exp(1) noise => argmax(p / q) draws from p: a 3-way distribution over many keys
    probs = torch.tensor([[0.6, 0.3, 0.1]]).expand(20000, 3)
    keys = torch.from_numpy(xs.row_keys(np.full(20000, 7, np.uint64), np.arange(20000)))
    draws = probs.div(xs.exponential_noise(keys, 3)).argmax(-1)
    freq = torch.bincount(draws, minlength=3).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.015, rtol=0)


def test_row_keys_match_torch_mixing():
    seeds, counters = np.array([0, 5, 1 << 40], np.uint64), np.array([0, 1, 2])
    keys = xs.row_keys(seeds, counters)
    assert keys.dtype == np.int64 and (keys >= 0).all() and (keys < (1 << 32)).all()
    assert len(set(keys.tolist())) == 3
    assert np.array_equal(xs.mix32(torch.from_numpy(keys)).numpy(), xs.mix32(keys.astype(np.uint64)).astype(np.int64))


def test_static_sampling_graph_semantics():
    V = 50
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    stop = torch.full((4, 8), V)
    top = logits.argmax(-1)
    stop[1, 0] = top[1]  # row 1: its best token is a stop id under min_tokens
    greedy = xs.sample_greedy(logits, stop)
    assert greedy[0] == top[0] and greedy[1] != top[1]
    args = dict(temperature=torch.tensor([1.0, 1.0, 0.7, 1.0]), top_k=torch.tensor([V, V, 1, V]),
                top_p=torch.ones(4), min_p=torch.zeros(4),
                is_greedy=torch.tensor([True, True, False, False]), keys=torch.tensor([0, 0, 3, 4]))
    out = xs.sample_random(logits, stop, **args)
    assert out[0] == top[0] and out[1] == greedy[1]
    assert out[2] == top[2]  # top_k = 1 is greedy
    assert torch.equal(out, xs.sample_random(logits, stop, **args))


def test_row_logprobs_trim_per_row():
    lp = xs.topk_logprobs(torch.randn(3, 30, generator=torch.Generator().manual_seed(0)), torch.tensor([1, 2, 3]), 5)
    rows = xs.RowLogprobs(lp.token_ids, lp.logprobs, lp.ranks, np.array([0, 5]))
    lists = rows.tolists()
    assert [len(t) for t in lists.token_ids] == [1, 6] and len(lists.ranks) == 2
    assert lists.token_ids[1][0] == 2
    assert math.isclose(lists.logprobs[1][0], lp.logprobs[1, 0].item())
