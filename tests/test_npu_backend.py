"""The Ascend NPU backend plugin, checked without torch_npu or an NPU.

Probe outcomes (not installed, failing import, no device), lazy import of
torch_npu, the 2 MiB-aligned split K/V layout on CPU tensors, attention over
that layout, and the engine end to end with the NPU layout on the CPU.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import pytest
import torch

from polyrunner.attention.metadata import LayerSpec
from polyrunner.attention.reference import reference_paged_attention, write_kv
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.backends.npu.kv_layout import ALIGNMENT, SplitKVLayout, allocate_split_kv
from polyrunner.backends.npu.plugin import NPUBackend, explain_capture_error, npu_paged_attention
from polyrunner.config import EngineConfig, ModelConfig, SchedulerConfig
from polyrunner.device.graphs import graph_bucket_policy
from polyrunner.device.kv_spec import KVCacheSpec
from polyrunner.plugins import hookimpl, list_backends, register
from polyrunner.plugins.manager import unregister
from test_cuda_backend import BATCHES, _qkv, make_batch, write_tiny_llama

NPU_INSTALLED = importlib.util.find_spec("torch_npu") is not None
not_installed = pytest.mark.skipif(NPU_INSTALLED, reason="torch_npu is installed here")


# ---- probe ---------------------------------------------------------------------
@not_installed
def test_probe_reports_not_installed():
    av = NPUBackend.probe()
    assert not av.available and av.reason == "torch_npu is not installed"
    with pytest.raises(RuntimeError, match="torch_npu is not installed"):
        NPUBackend(EngineConfig(model=ModelConfig()))


@not_installed
def test_plugins_do_not_import_torch_npu():
    import polyrunner.backends.cuda.plugin
    import polyrunner.backends.npu.plugin  # noqa: F401
    list_backends()
    NPUBackend.probe()
    assert "torch_npu" not in sys.modules


@not_installed
def test_list_backends_npu_unavailable():
    info = {i.name: i for i in list_backends()}["npu"]
    assert not info.availability.available
    assert info.availability.reason == "torch_npu is not installed" and info.graph_mode == "acl_graph"


def test_probe_reports_failed_import(monkeypatch):
    """A failing import is diagnosed (polyrunner.backends.diagnose): CANN's library missing."""
    from polyrunner.backends import diagnose
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(diagnose.importlib.util, "find_spec", lambda name: object())

    def broken(name):
        raise ImportError("libascendcl.so: cannot open shared object file")

    monkeypatch.setattr(diagnose.importlib, "import_module", broken)
    av = NPUBackend.probe()
    assert not av.available
    assert av.reason.startswith("torch_npu cannot load the CANN runtime (ImportError: libascendcl.so")
    assert "set_env.sh" in av.fix


def test_probe_reports_no_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    fake_npu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    assert NPUBackend.probe().reason == "no NPU device"
    monkeypatch.delattr(torch, "npu")
    assert NPUBackend.probe().reason == "no NPU device"  # torch_npu present but never registered torch.npu


def test_declarations():
    assert NPUBackend.kv_alignment_bytes == 2 * 1024 * 1024 == ALIGNMENT
    caps = NPUBackend.capabilities
    assert caps.graph_mode == "acl_graph" and caps.counts_graphs
    cfg = EngineConfig(model=ModelConfig(), scheduler=SchedulerConfig(max_num_seqs=48))
    assert graph_bucket_policy(cfg).token_buckets == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    hint = explain_capture_error(RuntimeError("capture failed, retCode=0x7020023, ..."))
    assert "insufficient streams" in hint
    assert caps.dtypes == (torch.bfloat16, torch.float16)


# ---- what torch_npu's ops take, refused at start-up ------------------------------------------------
def test_limits_name_the_field_the_rule_and_the_value():
    from polyrunner.backends.npu import limits
    for ok in (128, 256, 384, 512):
        limits.check_block_size(ok)
    for bad in (16, 64, 200, 640):
        with pytest.raises(ValueError, match=rf"block_size={bad} is not supported by backend 'npu'.*128 to 512 "
                                             r"in steps of 128; allowed: 128, 256, 384, 512"):
            limits.check_block_size(bad)
    for ok in (16, 64, 128, 256):
        limits.check_head_size(ok)
    for bad in (8, 24, 80 + 8, 272):
        with pytest.raises(ValueError, match=rf"head_size={bad} is not supported by backend 'npu': .*multiples of "
                                             r"16 up to 256"):
            limits.check_head_size(bad)
    limits.check_dtype(torch.float16)
    with pytest.raises(ValueError, match=r"dtype=float32 is not supported by backend 'npu'.*allowed: bfloat16, "
                                         r"float16"):
        limits.check_dtype(torch.float32)
    spec = KVCacheSpec(num_layers=1, block_size=128, num_kv_heads=2, head_size=40, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_size=40"):
        limits.check_kv_spec(spec)


def test_adjust_config_sets_and_checks_the_block_size():
    from polyrunner.config import CacheConfig
    unset = EngineConfig(model=ModelConfig())
    NPUBackend.adjust_config(unset)
    assert unset.cache.block_size == 128
    NPUBackend.adjust_config(EngineConfig(model=ModelConfig(), cache=CacheConfig(block_size=384)))
    with pytest.raises(ValueError, match="block_size=16 is not supported by backend 'npu'"):
        NPUBackend.adjust_config(EngineConfig(model=ModelConfig(), cache=CacheConfig(block_size=16)))


# ---- KV layout ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_blocks", [1, 7, 300])
def test_split_kv_layout(dtype, num_blocks):
    spec = KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=2, head_size=64, dtype=dtype)
    layout = SplitKVLayout.of(spec, num_blocks)
    caches = allocate_split_kv(spec, num_blocks, "cpu")
    assert len(caches) == 3
    for kv in caches:
        assert kv.shape == spec.layer_shape(num_blocks) and kv.dtype == dtype and kv.device.type == "cpu"
        k, v = kv[0], kv[1]
        assert k.is_contiguous() and v.is_contiguous()
        assert k.data_ptr() % ALIGNMENT == 0 and v.data_ptr() % ALIGNMENT == 0
        assert layout.half_bytes % ALIGNMENT == 0 and layout.half_bytes >= layout.raw_half_bytes
        assert v.data_ptr() - k.data_ptr() == layout.half_bytes           # K then V, padded halves
        assert k.data_ptr() + k.numel() * k.element_size() <= v.data_ptr()  # no overlap
        assert torch.count_nonzero(kv) == 0
    assert len({kv.data_ptr() for kv in caches}) == 3


def test_writes_through_logical_view_land_in_k_and_v_bytes():
    spec = KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    nb = 10
    layout = SplitKVLayout.of(spec, nb)
    kv = allocate_split_kv(spec, nb, "cpu")[0]
    slots = torch.tensor([0, 5, 13, 39])
    k = torch.randn(4, 2, 8).half()
    v = torch.randn(4, 2, 8).half()
    write_kv(kv, k, v, slots)
    raw = torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage())  # every byte of the buffer
    start = kv.storage_offset() * kv.element_size()
    k_bytes = raw[start: start + layout.raw_half_bytes].view(torch.float16).view(nb, 4, 2, 8)
    v_bytes = raw[start + layout.half_bytes: start + layout.half_bytes + layout.raw_half_bytes]
    v_bytes = v_bytes.view(torch.float16).view(nb, 4, 2, 8)
    blocks, offsets = slots // 4, slots % 4
    assert torch.equal(k_bytes[blocks, offsets], k) and torch.equal(v_bytes[blocks, offsets], v)
    pad = raw[start + layout.raw_half_bytes: start + layout.half_bytes]
    assert torch.count_nonzero(pad) == 0 and torch.count_nonzero(k_bytes) == torch.count_nonzero(k)


@pytest.mark.parametrize("budget_mib", [64, 65, 127, 1000])
def test_split_kv_fits_the_budget_within_one_alignment_per_layer(budget_mib):
    spec = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    budget = budget_mib << 20
    nb = spec.num_blocks_for(budget, ALIGNMENT)
    layout = SplitKVLayout.of(spec, nb)
    assert nb > 0 and layout.layer_bytes <= budget // spec.num_layers + ALIGNMENT


@pytest.mark.parametrize("batch", ["mixed", "long_decode"])
def test_attention_on_split_layout_matches_reference(batch):
    bs, nb, D = 16, 64, 32
    spec = LayerSpec(4, 2, D, D ** -0.5)
    reqs = BATCHES[batch]
    T = sum(n for _, n in reqs)
    meta = make_batch(reqs, block_size=bs, num_blocks=nb, max_blocks=12, T_pad=T + 3, R_pad=len(reqs) + 1, seed=3)
    q, k, v = _qkv(T + 3, spec, seed=4)
    kv_spec = KVCacheSpec(1, bs, 2, D, torch.float32)
    split = allocate_split_kv(kv_spec, nb, "cpu")[0]
    split.copy_(torch.randn(2, nb, bs, 2, D, generator=torch.Generator().manual_seed(5)))
    dense = split.clone()
    ref = reference_paged_attention(q, k, v, dense, meta, spec)
    out = npu_paged_attention(q, k, v, split, meta, spec)  # CPU tensors: the SDPA path
    torch.testing.assert_close(out[:T], ref[:T], rtol=1e-4, atol=1e-4)
    assert torch.equal(split, dense)


# ---- the engine on the NPU layout (CPU device) ---------------------------------------------
class SplitKVCPUBackend(CPUBackend):
    """The NPU plugin's KV layout, alignment and attention, on the CPU."""

    name = "cpu-npu-layout"
    kv_alignment_bytes = ALIGNMENT
    attention = staticmethod(npu_paged_attention)

    def allocate_kv_cache(self, spec, num_blocks):
        return allocate_split_kv(spec, num_blocks, "cpu", self.kv_alignment_bytes)


class _Plugin:
    PLUGIN_API_VERSION = "1.0"
    @staticmethod
    @hookimpl
    def polyrunner_backends():
        return [SplitKVCPUBackend]


def test_engine_on_split_kv_layout(tmp_path):
    from polyrunner import LLM, SamplingParams
    folder = write_tiny_llama(tmp_path / "tiny")
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, size=int(rng.integers(2, 40))).tolist()} for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    register(_Plugin, name="test-npu-layout")
    try:
        results = {}
        for backend in ("cpu", "cpu-npu-layout"):
            llm = LLM(str(folder), backend=backend, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                      kv_cache_memory_bytes=8 << 20)
            results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        kv = llm.engine.runner.kv_caches[0]
        assert kv[0].data_ptr() % ALIGNMENT == 0 and kv[1].data_ptr() % ALIGNMENT == 0
        assert results["cpu"] == results["cpu-npu-layout"]
    finally:
        unregister("test-npu-layout")


def test_split_kv_num_blocks_fit_the_budget():
    """The NPU block count accounts for K and V rounding and address alignment."""
    import torch

    from polyrunner.backends.npu.kv_layout import ALIGNMENT, allocate_split_kv, split_kv_num_blocks
    from polyrunner.device.kv_spec import KVCacheSpec
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    for budget in (5 * ALIGNMENT * 2, 7 * ALIGNMENT * 2 + 12345, 3 * ALIGNMENT * 2):
        n = split_kv_num_blocks(spec, budget)
        assert n > 0
        caches = allocate_split_kv(spec, n, "cpu")
        used = sum(c.untyped_storage().nbytes() for c in caches)
        assert used <= budget, (budget, n, used)
        assert split_kv_num_blocks(spec, budget + ALIGNMENT * 2 * spec.num_layers) > n
