"""The torch_npu test double refuses what the real ops document and emulates ACL graphs faithfully:

- rules (tests/npu_double/torch_npu/_rules.py): float32, a paged block size of 16 with more than one
  query token, TND with sparse_mode 4, head sizes the ops refuse, context lengths not on the host;
- workspaces: a task captured without `workspace=` keeps the workspace the op sized for the
  capture's lengths, so an update to a longer context is refused; so is a workspace sized for a
  short context; one sized for the largest context serves every update;
- task updates: a functional op re-issued at an update writes the fresh tensors that call returns,
  which the graph never reads (a stale output), the `.out` variant writes where the graph reads;
  a captured op keeps its host lengths until updated;
- the update protocol: a task group behind an ExternalEvent, updated on its own stream, the event
  recorded after graph_task_update_end, or the replay refuses (where the device would hang);
- a capture refuses host syncs (`.item()`, `.tolist()`);
- memory statistics follow live tensors, and the peak meter sees freed temporaries.
"""

from __future__ import annotations

import pytest
import torch

from npu_double_fixture import npu_double  # noqa: F401 - the fixture
from polyrunner.plugin_api import HostSyncError, host_tensor

BS, D, HQ, HKV = 128, 16, 2, 1


def _caches(blocks: int = 5, dtype: torch.dtype = torch.bfloat16, bs: int = BS, d: int = D):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(blocks, bs, HKV, d, generator=g).to(dtype) for _ in range(2))


def _lens(*n: int) -> torch.Tensor:
    return host_tensor(torch.tensor(n, dtype=torch.int32))


def _paged(q, kc, vc, lens, out, **extra) -> dict:
    table = torch.arange(1, 5, dtype=torch.int32)[None].expand(q.shape[0], 4).contiguous()
    return dict(query=q, key_cache=kc, value_cache=vc, num_kv_heads=HKV, num_heads=HQ, scale_value=0.25,
                block_table=table, context_lens=lens, out=out, **extra)


def _fia(q, kc, vc, layout: str, q_lens: list[int], kv_lens: list[int], **extra) -> dict:
    nb, bs, h, d = kc.shape
    table = torch.arange(1, 5, dtype=torch.int32)[None].expand(len(kv_lens), 4).contiguous()
    return dict(query=q, key=kc.view(nb, bs, h * d), value=vc.view(nb, bs, h * d), actual_seq_lengths=q_lens,
                actual_seq_lengths_kv=kv_lens, block_table=table, num_heads=HQ, scale=0.25, input_layout=layout,
                num_key_value_heads=HKV, block_size=bs, **extra)


def _mask() -> torch.Tensor:
    return torch.ones(2048, 2048, dtype=torch.bool).triu_(1)


# ---- the documented rules ------------------------------------------------------------------
def test_refuses_float32(npu_double):  # noqa: F811
    kc, vc = _caches(dtype=torch.float32)
    q = torch.randn(1, HQ, D)
    with pytest.raises(npu_double.DocError, match="query must be float16 or bfloat16, got torch.float32"):
        npu_double._npu_paged_attention(**_paged(q, kc, vc, _lens(10), torch.empty_like(q)))
    with pytest.raises(npu_double.DocError, match="float16 or bfloat16"):
        npu_double.npu_fused_infer_attention_score(**_fia(torch.randn(4, HQ, D), kc, vc, "TND", [4], [10],
                                                          atten_mask=_mask(), sparse_mode=3))


def test_refuses_block_size_16_for_prefill(npu_double):  # noqa: F811
    kc, vc = _caches(blocks=40, bs=16)
    q = torch.randn(4, HQ, D, dtype=torch.bfloat16)
    with pytest.raises(npu_double.DocError, match="block_size=16 with Q_S > 1: page attention takes 128 to 512"):
        npu_double.npu_fused_infer_attention_score(**_fia(q, kc, vc, "TND", [4], [10], atten_mask=_mask(),
                                                          sparse_mode=3))


def test_refuses_tnd_with_sparse_mode_4(npu_double):  # noqa: F811
    kc, vc = _caches()
    q = torch.randn(4, HQ, D, dtype=torch.bfloat16)
    call = _fia(q, kc, vc, "TND", [4], [10], atten_mask=_mask(), pre_tokens=7, next_tokens=0)
    with pytest.raises(npu_double.DocError, match="TND takes sparse_mode 0 without atten_mask or 3 with it"):
        npu_double.npu_fused_infer_attention_score(**call, sparse_mode=4)
    out, _ = npu_double.npu_fused_infer_attention_score(**call, sparse_mode=3)   # the documented pair runs
    assert out.shape == q.shape and out.abs().sum() > 0


def test_refuses_head_sizes_and_device_lengths(npu_double):  # noqa: F811
    kc, vc = _caches(d=24)
    with pytest.raises(npu_double.DocError, match="head dim 24: D must be a multiple of 16"):
        npu_double.npu_fused_infer_attention_score(**_fia(torch.randn(4, HQ, 24, dtype=torch.bfloat16), kc, vc, "TND",
                                                          [4], [10], atten_mask=_mask(), sparse_mode=3))
    kc, vc = _caches(d=272)
    q = torch.randn(1, HQ, 272, dtype=torch.bfloat16)
    with pytest.raises(npu_double.DocError, match="head_size=272 must be in"):
        npu_double._npu_paged_attention(**_paged(q, kc, vc, _lens(10), torch.empty_like(q)))
    kc, vc = _caches()
    q = torch.randn(1, HQ, D, dtype=torch.bfloat16)
    with pytest.raises(npu_double.DocError, match="HOST tensor"):   # context lengths are read on the host
        npu_double._npu_paged_attention(**_paged(q, kc, vc, torch.tensor([10], dtype=torch.int32),
                                                 torch.empty_like(q)))
    with pytest.raises(TypeError):   # the documented signature is enforced
        npu_double._npu_paged_attention(**_paged(q, kc, vc, _lens(10), torch.empty_like(q)), scale=1.0)


# ---- graphs: capture, update, replay ---------------------------------------------------------
class Decode:
    """A decode-attention graph captured as the docs describe, with a consumer of its output."""

    def __init__(self, tnpu, capture_len: int, workspace_len: int | None, functional: bool = False,
                 guarded: bool = True) -> None:
        self.tnpu = tnpu
        self.kc, self.vc = _caches()
        self.q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(1)).bfloat16()
        self.graph, self.update_stream = torch.npu.NPUGraph(), torch.npu.Stream()
        self.event = torch.npu.ExternalEvent()
        self.functional = functional
        with torch.npu.graph(self.graph):
            stream = torch.npu.current_stream()
            self.out = torch.zeros_like(self.q)
            ws = None if workspace_len is None else tnpu._npu_paged_attention_get_workspace(
                **_paged(self.q, self.kc, self.vc, _lens(workspace_len), self.out))
            self.kwargs = dict(workspace=ws) if ws is not None else {}
            if guarded:
                self.event.wait(stream)
                self.event.reset(stream)
            torch.npu.graph_task_group_begin(stream)
            self.attn = self.call(capture_len)
            self.handle = torch.npu.graph_task_group_end(stream)
            self.consumer = self.attn * 2           # what the rest of the graph reads

    def call(self, n: int):
        if self.functional:   # the fused op, one query token per batch (BSND, S = 1)
            return self.tnpu.npu_fused_infer_attention_score(**_fia(self.q.view(1, 1, HQ, D), self.kc, self.vc, "BSND",
                                                                      [1], [n]))[0]
        self.tnpu._npu_paged_attention(**_paged(self.q, self.kc, self.vc, _lens(n), self.out), **self.kwargs)
        return self.out

    def update(self, n: int):
        with torch.npu.stream(self.update_stream):
            torch.npu.graph_task_update_begin(self.update_stream, self.handle)
            fresh = self.call(n)
            torch.npu.graph_task_update_end(self.update_stream)
            self.event.record(self.update_stream)
        return fresh

    def expected(self, n: int) -> torch.Tensor:
        out = torch.zeros_like(self.q)
        self.tnpu._npu_paged_attention(**_paged(self.q, self.kc, self.vc, _lens(n), out))
        return out


def test_update_rebinds_host_lengths_with_a_workspace_for_the_largest_context(npu_double):  # noqa: F811
    dec = Decode(npu_double, capture_len=10, workspace_len=4 * BS)
    for n in (300, 10, 500):
        dec.update(n)
        dec.graph.replay()
        assert torch.equal(dec.out, dec.expected(n)) and torch.equal(dec.consumer, dec.expected(n) * 2)
    assert npu_double.REPLAYS["_npu_paged_attention"] == 3
    assert npu_double.LAST["_npu_paged_attention"]["blocks_read"] == 4


def test_a_captured_op_keeps_its_host_lengths_until_updated(npu_double):  # noqa: F811
    dec = Decode(npu_double, capture_len=300, workspace_len=4 * BS)
    dec.update(300)
    dec.graph.replay()
    assert torch.equal(dec.out, dec.expected(300))
    dec.out.zero_()
    dec.event.record(dec.update_stream)   # released without an update: the lengths stay the captured ones
    dec.graph.replay()
    assert torch.equal(dec.out, dec.expected(300)) and not torch.equal(dec.out, dec.expected(10))


@pytest.mark.parametrize("workspace_len", [None, 10])
def test_a_workspace_sized_for_the_capture_refuses_a_longer_context(npu_double, workspace_len):  # noqa: F811
    """No workspace (the op sizes its own for the capture's lengths) or one sized for the warm-up's short
    context: updating to a longer context is refused (on the device it overruns the workspace)."""
    dec = Decode(npu_double, capture_len=10, workspace_len=workspace_len)
    dec.update(100)   # the same 128-token tile: fits
    with pytest.raises(npu_double.GraphError if workspace_len is None else npu_double.DocError,
                       match="workspace"):
        dec.update(300)


def test_a_functional_op_reissued_at_an_update_leaves_the_graph_output_stale(npu_double):  # noqa: F811
    dec = Decode(npu_double, capture_len=10, workspace_len=None, functional=True)
    captured = dec.consumer.clone()
    fresh = dec.update(100)   # within the workspace the op sized at capture (one 128-token tile)
    dec.graph.replay()
    assert torch.equal(dec.consumer, captured)                      # the graph read the capture's output
    assert not torch.equal(fresh.view(1, HQ, D), dec.attn.view(1, HQ, D))   # the update's tensor got the new one
    torch.testing.assert_close(fresh.view(1, HQ, D), dec.expected(100), rtol=0, atol=2e-2)


def test_the_update_protocol_is_enforced(npu_double):  # noqa: F811
    unguarded = Decode(npu_double, capture_len=10, workspace_len=4 * BS, guarded=False)
    with pytest.raises(npu_double.GraphError, match="not guarded by an ExternalEvent"):
        unguarded.update(20)
    dec = Decode(npu_double, capture_len=10, workspace_len=4 * BS)
    with pytest.raises(npu_double.GraphError, match="never recorded"):   # the device would hang
        dec.graph.replay()
    default = torch.npu.current_stream()
    with pytest.raises(npu_double.GraphError, match="on its own stream"):
        torch.npu.graph_task_update_begin(default, dec.handle)
    with torch.npu.stream(dec.update_stream):
        torch.npu.graph_task_update_begin(dec.update_stream, dec.handle)
        dec.call(20)
        with pytest.raises(npu_double.GraphError, match="after graph_task_update_end"):
            dec.event.record(dec.update_stream)
        torch.npu.graph_task_update_end(dec.update_stream)


@pytest.mark.parametrize("sync", ["item", "tolist"])
def test_a_capture_refuses_host_syncs(npu_double, sync):  # noqa: F811
    x = torch.ones(3)
    with pytest.raises(HostSyncError), torch.npu.graph(torch.npu.NPUGraph()):
        getattr((x * 2).sum(), sync)()


# ---- memory ---------------------------------------------------------------------------------------
def test_memory_statistics_follow_live_tensors(npu_double):  # noqa: F811
    npu = torch.npu
    before = npu.memory_allocated()
    big = torch.zeros(8 << 20, dtype=torch.uint8)
    assert npu.memory_allocated() - before >= 8 << 20
    free, total = npu.mem_get_info()
    assert free == total - npu.memory_allocated()
    npu.reset_peak_memory_stats()
    start = npu.memory_allocated()
    tmp = torch.ones(16 << 20, dtype=torch.uint8) + 1   # a temporary and its result: 32 MiB at the peak
    del tmp
    assert npu.memory_allocated() - start < 1 << 20
    assert npu.max_memory_allocated() - start >= 32 << 20
    del big
