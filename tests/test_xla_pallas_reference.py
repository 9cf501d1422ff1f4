"""A CPU body for torch_xla's `xla::ragged_paged_attention`, and its checks.

The Pallas kernel needs a TPU (and JAX). `ragged_reference` computes the same function with fixed
shapes and no host read, so it can stand in for the kernel's XLA body inside a compiled step: the
graph is the TPU trace (the registered op, its schema, the padded metadata) with only the kernel
body swapped (`registered(ragged_reference, "XLA")`, used by tests/test_xla_pallas_trace.py).
Here it is checked against the float64 paged attention of the same inputs, with sliding windows
and soft caps, and against torch_xla's own non-kernel reference (`nonkernel`, which loops over
the requests on the host and serves the host-side tests of the Pallas call)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torch_xla", reason="torch_xla is not installed (see .ci/xla.sh)")

from polyrunner.backends.xla import pallas  # noqa: E402
from softcap_reference import softcap_attention  # noqa: E402
from test_xla_buckets import _paged_case  # noqa: E402
from tolerances import assert_close_ulp, assert_detects_errors  # noqa: E402

DEFAULT_MASK_VALUE = -0.7 * float(torch.finfo(torch.float32).max)   # torch_xla's


def ragged_reference(q: torch.Tensor, kv_pages: torch.Tensor, kv_lens: torch.Tensor, page_indices: torch.Tensor,
                     cu_q_lens: torch.Tensor, num_seqs: torch.Tensor, sm_scale: float = 1.0,
                     sliding_window: int | None = None, soft_cap: float | None = None,
                     mask_value: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
                     use_kernel: bool = True, num_kv_pages_per_block: int | None = None,
                     num_queries_per_block: int | None = None, vmem_limit_bytes: int | None = None) -> torch.Tensor:
    """`[T, Hq, D]`: ragged paged attention in the op's schema, with fixed shapes: each token finds
    its request in `cu_q_lens`, attends to the request's pages up to its own position (and the
    window), in float32; tokens of no request (past `cu_q_lens[num_seqs]`) get zeros."""
    T, Hq, D = q.shape
    page, combined = kv_pages.shape[1], kv_pages.shape[2]
    R, P = page_indices.shape
    token = torch.arange(T, device=q.device, dtype=torch.int32)
    ends = cu_q_lens[1:R + 1]
    row = (ends.unsqueeze(0) <= token.unsqueeze(1)).sum(1)             # [T] the token's request
    valid = row < num_seqs.to(row.dtype)
    row = row.clamp(max=R - 1).long()
    kv_len = kv_lens.long()[row]
    pos = kv_len - (ends.long()[row] - token.long())                   # [T] the token's position
    kv = kv_pages[page_indices.long()[row]].reshape(T, P * page, combined, D).float()
    k, v = kv[:, :, 0::2], kv[:, :, 1::2]                              # [T, L, Hkv, D]
    if k_scale is not None:
        k = k * k_scale
    if v_scale is not None:
        v = v * v_scale
    group = Hq // (combined // 2)
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("thd,tlhd->thl", q.float(), k) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    key = torch.arange(P * page, device=q.device).unsqueeze(0)         # [1, L]
    visible = (key <= pos.unsqueeze(1)) & (key < kv_len.unsqueeze(1))
    if sliding_window is not None:
        visible = visible & (key > pos.unsqueeze(1) - sliding_window)
    scores = scores.masked_fill(~visible.unsqueeze(1), DEFAULT_MASK_VALUE if mask_value is None else mask_value)
    out = torch.einsum("thl,tlhd->thd", torch.softmax(scores, dim=-1), v)
    return torch.where(valid[:, None, None], out, 0.0).to(q.dtype)


def nonkernel(q: torch.Tensor, kv_pages: torch.Tensor, kv_lens: torch.Tensor, page_indices: torch.Tensor,
              cu_q_lens: torch.Tensor, num_seqs: torch.Tensor, sm_scale: float = 1.0,
              sliding_window: int | None = None, soft_cap: float | None = None, mask_value: float | None = None,
              k_scale: float | None = None, v_scale: float | None = None, use_kernel: bool = True,
              **tuning: int | None) -> torch.Tensor:
    """torch_xla's non-kernel reference in the op's schema (host loop: for host tensors only)."""
    from torch_xla.experimental.custom_kernel import _ragged_paged_attention_nonkernel
    out = _ragged_paged_attention_nonkernel(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap,
        mask_value=DEFAULT_MASK_VALUE if mask_value is None else mask_value)
    return torch.cat([out, out.new_zeros(q.shape[0] - out.shape[0], *out.shape[1:])])


@contextlib.contextmanager
def registered(body: Callable[..., torch.Tensor], *keys: str) -> Iterator[list[tuple]]:
    """`body` as the kernel of `torch.ops.xla.ragged_paged_attention` for dispatch `keys` (e.g.
    "XLA", "CPU") while inside; torch_xla's kernels are back afterwards. Yields the list of the
    (q, kv_pages) shapes each call saw."""
    pallas.define_ops()
    calls: list[tuple] = []

    def recording(q: torch.Tensor, kv_pages: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append((tuple(q.shape), tuple(kv_pages.shape)))
        return body(q, kv_pages, *args, **kwargs)

    lib = torch.library.Library("xla", "IMPL")
    try:
        with warnings.catch_warnings():   # the override is the point
            warnings.filterwarnings("ignore", "Warning only once for all operators")
            for key in keys:
                lib.impl("ragged_paged_attention", recording, key, allow_override=True)
        yield calls
    finally:
        lib._destroy()


def pallas_case(seed: int, window: int | None, cap: float | None = None):
    """`_paged_case` in the Pallas layout: (q, k, v, pages, meta with the kernel's extras, spec, T)."""
    q, k, v, cache, meta, spec, T = _paged_case(seed, window)
    nb, bs, hkv, d = cache.shape[1:]
    pages = torch.stack([cache[0], cache[1]], dim=3).reshape(nb, bs, 2 * hkv, d)
    step = SimpleNamespace(num_reqs=3, num_tokens=T, seq_lens=meta.seq_lens_np,
                           block_tables=meta.block_tables.numpy(), query_start_loc=meta.query_start_loc_np)
    extras = {key: torch.from_numpy(a) for key, a in pallas.host_inputs(step, 8).items()}
    spec = dataclasses.replace(spec, logits_soft_cap=cap)
    return q, k, v, pages, dataclasses.replace(meta, extras=extras), spec, T


@pytest.mark.parametrize("cap", [None, 2.0], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", [None, 4], ids=["full", "window"])
def test_reference_is_paged_attention(window, cap):
    """Through `pallas.attention` (the registered op, on host tensors): the float64 attention of
    the same inputs to fp32 rounding, torch_xla's non-kernel reference, and zeros on padded rows."""
    q, k, v, pages, meta, spec, T = pallas_case(2, window, cap)
    q = 3 * q                                          # scores reach the cap
    want, bound = softcap_attention(q, k, v, torch.stack([pages[:, :, 0::2], pages[:, :, 1::2]]), meta, spec)
    with registered(ragged_reference, "CPU") as calls:
        got = pallas.attention(q, k, v, pages.clone(), meta, spec)
    with registered(nonkernel, "CPU"):
        theirs = pallas.attention(q, k, v, pages.clone(), meta, spec)
    assert calls == [(tuple(q.shape), tuple(pages.shape))]
    assert_detects_errors(lambda out: assert_close_ulp(out, want[:T], torch.float32, ulps=1, abs_err=bound[:T]),
                          got[:T])
    assert_close_ulp(got[:T], theirs[:T], torch.float32, ulps=1, abs_err=2 * bound[:T])
    assert torch.equal(got[T:], torch.zeros_like(got[T:]))
