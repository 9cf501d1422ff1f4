"""Nothing inside a captured NPU decode step synchronises with the host (the core's capture guard,
which the graph executor enters around every capture; the torch_npu double's graphs run under it):

- a host read planted in the model's decoder layer (`.item()`, `.tolist()` of a device tensor) fails
  start-up's capture with HostSyncError, while the same engine runs eagerly;
- a Mixtral (top-2 of 4 experts) runs captured decode steps on the double, without a host sync:
  graphs replay, and its greedy tokens equal the CPU backend's in the same dtype (near-ties aside).
"""

from __future__ import annotations

import pytest

from moe_tiny_models import build_moe_model
from npu_double_fixture import npu_double  # noqa: F401 - the fixture
from polyrunner import LLM
from polyrunner.models.decoder import DecoderLayer
from polyrunner.plugin_api import HostSyncError
from test_cuda_backend import write_tiny_llama
from test_npu_double import KV_BYTES, assert_tokens_match, generate, prompts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Llama and Mixtral, built before the double is imported."""
    root = tmp_path_factory.mktemp("npu_capture")
    build_moe_model("mixtral", root / "mixtral")
    return {"llama": write_tiny_llama(root / "llama"), "mixtral": root / "mixtral"}


@pytest.mark.parametrize("read", ["item", "tolist"])
def test_a_host_read_in_a_captured_step_fails_start_up(models, npu_double, monkeypatch, read):  # noqa: F811
    forward = DecoderLayer.forward

    def planted(self, positions, x, *args, **kwargs):
        getattr(x[:1, :1].sum(), read)()   # a device value read on the host
        return forward(self, positions, x, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", planted)
    options = dict(backend="npu", dtype="bfloat16", max_num_seqs=2, kv_cache_memory_bytes=KV_BYTES)
    with pytest.raises(HostSyncError, match=rf"capturing the decode graph .*Tensor\.{read}\(\)|scalar read"):
        LLM(str(models["llama"]), **options)
    LLM(str(models["llama"]), enforce_eager=True, **options)   # eagerly the read is allowed


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_mixtral_decodes_in_graphs_without_a_host_sync(models, npu_double, dtype):  # noqa: F811
    batch = prompts(3, 4, 100, 200)
    _, want = generate(models["mixtral"], "cpu", batch, 8, dtype, logprobs=5, block_size=128,
                       max_num_batched_tokens=64)
    llm, got = generate(models["mixtral"], "npu", batch, 8, dtype, max_num_batched_tokens=64)
    assert_tokens_match(got, want)
    counters = llm.engine.runner.executor.counters()
    assert counters["replays"] > 0 and counters["graphs"], counters
    assert npu_double.REPLAYS["_npu_paged_attention"] == 2 * counters["replays"]   # 2 layers per replay
