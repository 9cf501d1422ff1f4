"""The XLA backend's Pallas path passes the logit soft cap (`LayerSpec.logits_soft_cap`, Gemma 2) to
torch_xla's registered op `torch.ops.xla.ragged_paged_attention` (`soft_cap=`): `pallas.attention` on
host tensors, with torch_xla's own non-kernel reference registered as the op's CPU kernel (the
Pallas kernel needs a TPU), compared with the float64 direct formula (`softcap_reference`), with and
without a window."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torch_xla", reason="torch_xla is not installed (see .ci/xla.sh)")

from polyrunner.backends.xla import pallas  # noqa: E402
from softcap_reference import softcap_attention  # noqa: E402
from test_xla_buckets import _paged_case  # noqa: E402
from test_xla_pallas_reference import nonkernel, registered  # noqa: E402
from tolerances import assert_close_ulp, assert_detects_errors  # noqa: E402

CAP = 2.0


@pytest.mark.parametrize("cap", [None, CAP], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", [None, 4], ids=["full", "window"])
def test_pallas_attention_passes_the_soft_cap(cap, window):
    q, k, v, cache, meta, spec, T = _paged_case(2, window)
    q = 3 * q                                   # scores reach the cap
    spec = dataclasses.replace(spec, logits_soft_cap=cap)
    expected, bound = softcap_attention(q, k, v, cache, meta, spec)
    nb, bs, hkv, d = cache.shape[1:]
    pages = torch.stack([cache[0], cache[1]], dim=3).reshape(nb, bs, 2 * hkv, d)
    step = SimpleNamespace(num_reqs=3, num_tokens=T, seq_lens=meta.seq_lens_np,
                           block_tables=meta.block_tables.numpy(), query_start_loc=meta.query_start_loc_np)
    extras = {key: torch.from_numpy(a) for key, a in pallas.host_inputs(step, 8).items()}
    with registered(nonkernel, "CPU") as calls:
        got = pallas.attention(q, k, v, pages, dataclasses.replace(meta, extras=extras), spec)
    assert len(calls) == 1

    def check(out):
        assert_close_ulp(out, expected[:T], torch.float32, ulps=1, abs_err=bound[:T])

    assert_detects_errors(check, got[:T])
    if cap is not None:
        uncapped, _ = softcap_attention(q, k, v, cache, meta, dataclasses.replace(spec, logits_soft_cap=None))
        with pytest.raises(AssertionError):
            check(uncapped[:T])
