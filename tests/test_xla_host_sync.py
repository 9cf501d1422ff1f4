"""A host sync planted in the XLA step is refused, in both execution modes, as `HostSyncError`.

Lazy trace (`POLYRUNNER_XLA_DYNAMO=0`): the executor traces the forward inside the core's capture
guard, which refuses the op. Dynamo (the default): fullgraph refuses it as a graph break, and the
executor reports that as the guard's error, naming the op and the user code, chained to dynamo's
(`host_sync.from_dynamo`, whose classification of dynamo's graph-break types is checked here too)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed (see .ci/xla.sh)")
os.environ.setdefault("PJRT_DEVICE", "CPU")

from polyrunner import LLM  # noqa: E402
from polyrunner.backends.xla import host_sync  # noqa: E402
from polyrunner.backends.xla import plugin as xla_plugin  # noqa: E402
from polyrunner.plugin_api import HostSyncError  # noqa: E402

OPTIONS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=16,
               kv_cache_memory_bytes=1 << 20, request_buckets=[4])


def _item(x):
    return x * x.sum().item()


def _bincount(x):
    return torch.bincount(x.long().abs() % 4).tolist()


def _branch(x):
    return x if x.sum() > 0 else -x


def _numpy(x):
    return x * float(x.numpy().sum())


def _not_a_sync(x):
    torch._dynamo.graph_break()
    return x


@pytest.mark.parametrize("fn,op", [(_item, "Tensor.item()"), (_bincount, "aten.bincount.default"),
                                   (_branch, "a branch on a tensor's value"),
                                   (_numpy, "aten._local_scalar_dense.default"), (_not_a_sync, None)])
def test_dynamo_refusals_are_named(fn, op):
    import torch._dynamo
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(fn, backend="eager", fullgraph=True)(torch.randn(8))
    error = host_sync.from_dynamo(info.value)
    if op is None:
        assert error is None
        return
    assert isinstance(error, HostSyncError) and str(error).startswith(op)
    assert f"in {fn.__name__}:" in str(error)          # the user code that calls it


def _plant(real, q, k, v, kv_cache, meta, spec):
    scale = meta.seq_lens.max().item()
    return real(q, k, v, kv_cache, meta, spec) * (scale > 0)


@pytest.mark.parametrize("dynamo", ["1", "0"], ids=["dynamo", "trace"])
def test_a_planted_item_is_refused(tiny_model_factory, monkeypatch, dynamo):
    """`.item()` planted in the attention of a real model: the engine's first compiled step refuses it."""
    monkeypatch.setenv("POLYRUNNER_XLA_DYNAMO", dynamo)
    monkeypatch.setattr(xla_plugin, "static_shape_paged_attention",
                        functools.partial(_plant, xla_plugin.static_shape_paged_attention))
    with pytest.raises(HostSyncError, match=r"Tensor\.item\(\)") as info:
        LLM(str(tiny_model_factory("llama")[0]), backend="xla", **OPTIONS)
    if dynamo == "1":
        assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported)
        assert "in _plant: scale = meta.seq_lens.max().item()" in str(info.value)
    else:
        assert info.value.__cause__ is None          # the capture guard's own refusal
