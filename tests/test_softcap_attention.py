"""Attention logit soft-capping and sliding windows in the core's attention paths
(reference, batched SDPA/online-softmax, static shape) against the direct formula
softmax(mask(cap * tanh(scale q.k / cap))) v in float64; and the engine's refusal of a
model whose attention needs a feature the backend does not declare."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from polyrunner.attention.batched import sdpa_paged_attention
from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import reference_paged_attention
from polyrunner.attention.static_shape import static_shape_paged_attention

BS, HQ, HKV, D, NUM_BLOCKS = 4, 4, 2, 8, 24
CTX = [13, 1, 11, 17]    # seq_len after this step: two decodes, a fresh prompt, a chunk after context
NEW = [1, 1, 11, 6]      # this step's query tokens
PATHS = {"reference": reference_paged_attention, "batched": sdpa_paged_attention,
         "static_shape": static_shape_paged_attention}


def _case(seed: int):
    """A padded step (2 padded tokens, 1 padded request) over a random pool; q/k/v large
    enough (scores of a few units) that a cap of 2 changes them."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    R, T = len(CTX), sum(NEW)
    T_pad, width = T + 2, -(-max(CTX) // BS)
    free = rng.permutation(np.arange(1, NUM_BLOCKS))
    tables = np.zeros((R + 1, width), np.int32)
    used = 0
    for r, L in enumerate(CTX):
        n = -(-L // BS)
        tables[r, :n] = free[used:used + n]
        used += n
    qsl = np.concatenate([[0], np.cumsum(NEW), [T]]).astype(np.int32)
    req = np.repeat(np.arange(R), NEW)
    pos = np.concatenate([np.arange(L - n, L) for L, n in zip(CTX, NEW)])
    slots = tables[req, pos // BS].astype(np.int64) * BS + pos % BS
    pad = np.zeros(T_pad - T, np.int64)
    seq_lens = np.array(CTX + [0], np.int32)
    meta = AttentionMetadata(
        num_actual_tokens=T, num_reqs=R, num_decodes=2, max_query_len=max(NEW), max_seq_len=max(CTX),
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        block_tables=torch.from_numpy(tables), slot_mapping=torch.from_numpy(np.concatenate([slots, pad])),
        positions=torch.from_numpy(np.concatenate([pos, pad])),
        token_to_req=torch.from_numpy(np.concatenate([req, pad]).astype(np.int32)),
        query_start_loc_np=qsl, seq_lens_np=seq_lens)
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D, generator=g) * 2
    q, k, v = (torch.randn(T_pad, h, D, generator=g) * 2 for h in (HQ, HKV, HKV))
    return q, k, v, cache, meta


def _direct(q, k, v, cache, meta, spec) -> torch.Tensor:
    """The formula, request by request and query by query, in float64 (the test's oracle)."""
    cache = cache.double().clone()
    for t in range(meta.num_actual_tokens):
        s = int(meta.slot_mapping[t])
        cache[0, s // BS, s % BS], cache[1, s // BS, s % BS] = k[t].double(), v[t].double()
    out = torch.zeros(meta.num_actual_tokens, HQ, D, dtype=torch.float64)
    for t in range(meta.num_actual_tokens):
        r, p = int(meta.token_to_req[t]), int(meta.positions[t])
        keys = torch.arange(p + 1)
        if spec.sliding_window is not None:
            keys = keys[keys > p - spec.sliding_window]
        blocks = meta.block_tables[r].long()[keys // BS]
        ck, cv = cache[0, blocks, keys % BS], cache[1, blocks, keys % BS]   # [L, Hkv, D]
        for h in range(HQ):
            scores = ck[:, h // (HQ // HKV)] @ q[t, h].double() * spec.scale
            if spec.logits_soft_cap is not None:
                scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
            out[t, h] = torch.softmax(scores, 0) @ cv[:, h // (HQ // HKV)]
    return out


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_attention_paths_match_the_formula(path, window, cap):
    q, k, v, cache, meta = _case(0)
    spec = LayerSpec(HQ, HKV, D, D ** -0.5, window, cap)
    want = _direct(q, k, v, cache, meta, spec)
    got = PATHS[path](q, k, v, cache.clone(), meta, spec)[: meta.num_actual_tokens].double()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    if cap is not None:   # the cap changes the result: the check above could fail without it
        uncapped = _direct(q, k, v, cache, meta, dataclasses.replace(spec, logits_soft_cap=None))
        assert (uncapped - want).abs().max() > 1e-2


def test_batched_decode_under_static_decode_flag_caps():
    """The graph-capture decode (every row a decode, full block-table width) applies the cap too."""
    from polyrunner.attention.batched import paged_decode
    q, k, v, cache, meta = _case(1)
    spec = LayerSpec(HQ, HKV, D, D ** -0.5, 5, 2.0)
    want = _direct(q, k, v, cache, meta, spec)[:2]
    reference_paged_attention(q, k, v, cache, meta, spec)   # writes this step's k/v
    got = paged_decode(q[:2], cache, meta.block_tables[:2], meta.seq_lens[:2], spec, meta.block_tables.shape[1])
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
