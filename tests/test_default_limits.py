"""Scheduler limits the user leaves unset take the backend's `default_limits` (vLLM's
device-dependent defaults on CUDA); explicit values always win; CPU keeps 64 / 2048."""

from __future__ import annotations

import argparse
import types

import pytest
import torch

from polyrunner import LLM
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.backends.cuda.defaults import cuda_default_limits
from polyrunner.backends.cuda.plugin import CUDABackend
from polyrunner.config import EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from polyrunner.default_limits import apply_default_limits
from polyrunner.plugins import create_backend, hookimpl, register
from polyrunner.plugins.manager import unregister
from polyrunner.tools.engine_args import add_engine_args, engine_kwargs

GiB = 1 << 30


def fake_gpu(monkeypatch, memory: int, name: str) -> None:
    props = types.SimpleNamespace(total_memory=memory, name=name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


@pytest.mark.parametrize("memory,name,usage,tokens,seqs", [
    (141 * GiB, "NVIDIA H200", "LLM_CLASS", 16384, 1024),
    (141 * GiB, "NVIDIA H200", "OPENAI_API_SERVER", 8192, 1024),
    (80 * GiB, "NVIDIA H100 80GB HBM3", "LLM_CLASS", 16384, 1024),
    (70 * GiB, "AMD Instinct MI300X", "OPENAI_API_SERVER", 8192, 1024),
    (80 * GiB, "NVIDIA A100-SXM4-80GB", "LLM_CLASS", 8192, 256),   # vLLM keeps A100 on the smaller table
    (70 * GiB - 1, "NVIDIA H100", "LLM_CLASS", 8192, 256),
    (24 * GiB, "NVIDIA L4", "LLM_CLASS", 8192, 256),
    (24 * GiB, "NVIDIA L4", "OPENAI_API_SERVER", 2048, 256),
])
def test_cuda_defaults_follow_vllms_table(monkeypatch, memory, name, usage, tokens, seqs):
    fake_gpu(monkeypatch, memory, name)
    want = {"max_num_batched_tokens": tokens, "max_num_seqs": seqs}
    assert cuda_default_limits(usage) == want
    assert CUDABackend.default_limits(usage) == want


def config(max_model_len: int | None = 4096, usage: str = "LLM_CLASS", **limits) -> EngineConfig:
    return EngineConfig(model=ModelConfig(max_model_len=max_model_len), scheduler=SchedulerConfig(**limits),
                        runner=RunnerConfig(usage_context=usage))


H200 = {"max_num_batched_tokens": 16384, "max_num_seqs": 1024}


def limits(cfg: EngineConfig) -> tuple[int, int]:
    return cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens


def test_unset_limits_take_the_defaults_and_explicit_values_win():
    cfg = config()
    apply_default_limits(cfg, H200, lambda: 4096)
    assert limits(cfg) == (1024, 16384)
    cfg = config(max_num_seqs=8, max_num_batched_tokens=512)
    apply_default_limits(cfg, H200, lambda: pytest.fail("no defaulted budget: max_model_len is not needed"))
    assert limits(cfg) == (8, 512)
    cfg = config(max_num_seqs=64)   # the config's own default, passed explicitly, still wins
    apply_default_limits(cfg, H200, lambda: 4096)
    assert limits(cfg) == (64, 16384)
    cfg = config(max_num_batched_tokens=256)   # a defaulted max_num_seqs is capped by the budget (vLLM)
    apply_default_limits(cfg, H200, lambda: 4096)
    assert limits(cfg) == (256, 256)


def test_defaulted_budget_is_clamped_as_in_vllm():
    cfg = config(max_num_seqs=4)   # at most max_num_seqs * max_model_len
    apply_default_limits(cfg, H200, lambda: 1000)
    assert limits(cfg) == (4, 4000)
    cfg = config(max_model_len=None, enable_chunked_prefill=False)   # at least max_model_len without chunking
    apply_default_limits(cfg, H200, lambda: 32768)
    assert limits(cfg) == (1024, 32768)
    with pytest.raises(ValueError, match="allowed keys"):
        apply_default_limits(config(), {"max_num_sequences": 4}, lambda: 64)


def test_empty_defaults_keep_the_config_defaults():
    cfg = config()
    apply_default_limits(cfg, CPUBackend.default_limits("LLM_CLASS"), lambda: 64)
    assert limits(cfg) == (64, 2048)
    assert CPUBackend.default_limits("OPENAI_API_SERVER") == {}


class BigGPULikeCPU(CPUBackend):
    """CPU that reports the CUDA backend's defaults of a (fake) 141 GiB device."""

    name = "cpu-big-gpu-defaults"
    priority = -100

    @classmethod
    def default_limits(cls, usage):
        return cuda_default_limits(usage)


class _Plugin:
    PLUGIN_API_VERSION = "1.0"

    @hookimpl
    def polyrunner_backends(self):
        return [BigGPULikeCPU]


@pytest.fixture
def big_gpu(monkeypatch):
    fake_gpu(monkeypatch, 141 * GiB, "NVIDIA H200")
    register(_Plugin(), name="test-default-limits")
    yield BigGPULikeCPU.name
    unregister("test-default-limits")


def test_create_backend_applies_the_backends_defaults_per_usage(big_gpu):
    for usage, want in (("LLM_CLASS", (1024, 16384)), ("OPENAI_API_SERVER", (1024, 8192))):
        cfg = config(usage=usage)
        cfg.runner.backend = big_gpu
        create_backend(cfg)
        assert limits(cfg) == want
        again = EngineConfig.model_validate(cfg.model_dump())   # a tensor-parallel worker's copy keeps them
        create_backend(again)
        assert limits(again) == want
    cfg = config(max_num_seqs=3, max_num_batched_tokens=48)
    cfg.runner.backend = big_gpu
    create_backend(cfg)
    assert limits(cfg) == (3, 48)


def test_llm_passes_only_what_the_user_set(big_gpu, tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    llm = LLM(str(folder), backend=big_gpu, max_model_len=64, max_num_batched_tokens=64,
              num_gpu_blocks_override=16)
    assert limits(llm.engine.config) == (64, 64)   # max_num_seqs from the defaults, capped by the budget
    cpu = LLM(str(folder), backend="cpu", max_model_len=64, num_gpu_blocks_override=16)
    assert limits(cpu.engine.config) == (64, 2048)   # CPU: today's values


def test_cli_leaves_the_limits_unset_unless_given():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args([]))
    assert kwargs["max_num_seqs"] is None and kwargs["max_num_batched_tokens"] is None
    kwargs = engine_kwargs(parser.parse_args(["--max-num-seqs", "7", "--max-num-batched-tokens", "99"]))
    assert kwargs["max_num_seqs"] == 7 and kwargs["max_num_batched_tokens"] == 99
