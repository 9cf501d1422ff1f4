"""A mixture-of-experts model (tiny Mixtral) on the XLA backend (CPU PJRT device), in both modes.

The core's MoE reference groups tokens by expert with counts read on the host
(`bincount(...).tolist()`), which no compiled graph can hold; inside a captured or compiled step
(`in_static_step()`) it takes its fixed-shape path instead. Here the compiled decode steps give the
CPU backend's greedy tokens (float32) with no compilation after warm-up (strict mode) and, under
dynamo, no second trace; forcing the grouped path back is refused as a host sync naming bincount."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed (see .ci/xla.sh)")
os.environ.setdefault("PJRT_DEVICE", "CPU")

from moe_tiny_models import build_moe_model  # noqa: E402
from polyrunner import LLM, SamplingParams  # noqa: E402
from polyrunner.plugin_api import HostSyncError  # noqa: E402

OPTIONS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, block_size=16,
               kv_cache_memory_bytes=1 << 21)
MODES = {"dynamo": "1", "trace": "0"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    build_moe_model("mixtral", path)
    return path


@pytest.fixture(scope="module")
def cpu(folder):
    return LLM(str(folder), backend="cpu", **OPTIONS)


def _ids(llm, prompts, n):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", MODES)
def test_mixtral_decodes_like_the_cpu_backend(folder, cpu, monkeypatch, mode):
    monkeypatch.setenv("POLYRUNNER_XLA_DYNAMO", MODES[mode])
    xla = LLM(str(folder), backend="xla", strict_no_recompile=True, request_buckets=[4], **OPTIONS)
    ex = xla.engine.runner.executor
    assert ex.mode == mode and ex.warm
    traces = len(ex.traces)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (4, 11, 27, 6)]
    assert _ids(xla, prompts, 10) == _ids(cpu, prompts, 10)
    assert ex.serving_graphs == 0 and len(ex.traces) == traces == (2 if mode == "dynamo" else 0)


@pytest.mark.parametrize("mode", MODES)
def test_the_grouped_path_is_refused_in_a_compiled_step(folder, monkeypatch, mode):
    """The fixed-shape path is what makes the step compile: with the grouped path forced, the first
    backbone is refused, naming bincount (dynamo: its graph break; trace: the capture guard)."""
    import polyrunner.ops.moe as moe
    monkeypatch.setenv("POLYRUNNER_XLA_DYNAMO", MODES[mode])
    monkeypatch.setattr(moe, "in_static_step", lambda: False)
    with pytest.raises(HostSyncError, match="bincount") as info:
        LLM(str(folder), backend="xla", request_buckets=[4], **OPTIONS)
    assert (info.value.__cause__ is not None) == (mode == "dynamo")
