"""dtype="auto": the checkpoint's torch_dtype where the backend computes it
natively, else float32; the CPU backend counts bfloat16 as native with
AVX512_BF16 or AMX."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from polyrunner import LLM, SamplingParams
from polyrunner.backends.cpu import plugin as cpu_plugin
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.config import EngineConfig, ModelConfig
from polyrunner.device.backend import Backend
from polyrunner.models.loader import checkpoint_dtype

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
NATIVE_BF16, WHY_BF16 = cpu_plugin.native_bf16()
CONFIG = EngineConfig(model=ModelConfig())


class _Device(Backend):
    name = "fake"

    def __init__(self, native: tuple[torch.dtype, ...], default: torch.dtype = F32) -> None:
        super().__init__(CONFIG)
        self._native, self._default = native, default

    @property
    def default_dtype(self) -> torch.dtype:
        return self._default

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        return self._native


@pytest.mark.parametrize("native,model,want", [
    ((BF16, F32), BF16, BF16),      # the model's dtype, native
    ((BF16, F32), F32, F32),        # a float32 checkpoint stays float32
    ((F32,), BF16, F32),            # not native: float32
    ((BF16, F32), F16, F32),        # float16 where only bfloat16 is native: float32, not a cast to bf16
    ((BF16, F16, F32), F16, F16),
])
def test_resolve_dtype_prefers_the_models_native_dtype(native, model, want):
    dtype, why = _Device(native).resolve_dtype(model)
    assert dtype == want
    assert ("not native" in why) == (model != want)


def test_resolve_dtype_without_a_checkpoint_dtype_is_the_backend_default():
    dtype, why = _Device((BF16, F32), default=BF16).resolve_dtype(None)
    assert dtype == BF16 and "no torch_dtype" in why


def test_default_native_dtypes_are_the_default_dtype_and_float32():
    class Plain(Backend):
        default_dtype = BF16
    assert Plain(CONFIG).native_dtypes() == (BF16, F32)
    assert Backend(CONFIG).native_dtypes() == (F32,)


@pytest.mark.parametrize("cfg,want", [
    ({"torch_dtype": "bfloat16"}, BF16), ({"dtype": "float16"}, F16), ({"torch_dtype": "torch.float32"}, F32),
    ({}, None), ({"torch_dtype": "float64"}, None), ({"torch_dtype": None, "dtype": "bfloat16"}, BF16),
])
def test_checkpoint_dtype_reads_torch_dtype_or_dtype(cfg, want):
    assert checkpoint_dtype(cfg) == want


@pytest.mark.parametrize("native", [True, False])
def test_cpu_native_dtypes_follow_the_bf16_detection(monkeypatch, native):
    monkeypatch.setattr(cpu_plugin, "native_bf16", lambda: (native, "test says so"))
    backend = CPUBackend(CONFIG)
    assert backend.native_dtypes() == ((BF16, F32) if native else (F32,))
    dtype, why = backend.resolve_dtype(BF16)
    assert dtype == (BF16 if native else F32) and why.endswith("test says so")
    assert backend.resolve_dtype(F16)[0] == F32  # no float16 fast path on the CPU backend


def test_native_bf16_detection_agrees_with_the_cpu_flags():
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"/proc/cpuinfo flags are checked on x86 only (this is {platform.machine()})")
    flags = cpu_plugin._proc_cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags line (not Linux)")
    from polyrunner.backends.cpu import kernels
    fast = bool({"avx512_bf16", "amx_bf16"} & flags) or ("avx512f" in flags and kernels.avx512_available())
    assert cpu_plugin.native_bf16()[0] == fast, cpu_plugin.native_bf16()[1]


def test_avx512f_without_bf16_hardware_counts_only_with_the_kernel(monkeypatch):
    """A CPU with AVX-512F but neither AVX512_BF16 nor AMX runs bfloat16 natively exactly when
    the AVX-512F bfloat16 linear can run (POLYRUNNER_CPU_AVX512=0 takes it away)."""
    import platform

    from polyrunner.backends.cpu import kernels
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"x86 only (this is {platform.machine()})")
    monkeypatch.setattr(cpu_plugin, "_bf16_hardware", lambda: (False, "no bf16 hardware (test)"))
    monkeypatch.setattr(kernels, "avx512_available", lambda: True)
    ok, why = cpu_plugin.native_bf16()
    assert ok and "AVX-512F" in why
    monkeypatch.setattr(kernels, "avx512_available", lambda: False)
    assert cpu_plugin.native_bf16()[0] is False


# ---- through the engine ----------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_model_factory, tmp_path_factory):
    """The tiny llama with config.json saying bfloat16 (the weights stay float32 on disk)."""
    folder, _ = tiny_model_factory("llama")
    out = tmp_path_factory.mktemp("tiny-llama-bf16")
    shutil.copytree(folder, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SMALL = dict(backend="cpu", max_model_len=128, kv_cache_memory_bytes=8 << 20)


@pytest.mark.skipif(not NATIVE_BF16, reason=f"no native bfloat16 here: {WHY_BF16}")
def test_bf16_checkpoint_runs_bf16_on_a_native_cpu(bf16_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="polyrunner.engine.model_setup"):
        llm = LLM(str(bf16_checkpoint), **SMALL)
    assert llm.engine.dtype == BF16
    assert any("dtype auto -> bfloat16" in r.getMessage() for r in caplog.records)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_bf16_checkpoint_falls_back_to_float32_without_native_bf16(bf16_checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(cpu_plugin, "native_bf16", lambda: (False, "this CPU has neither AVX512_BF16 nor AMX"))
    with caplog.at_level(logging.INFO, logger="polyrunner.engine.model_setup"):
        llm = LLM(str(bf16_checkpoint), **SMALL)
    assert llm.engine.dtype == F32
    msg = next(r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage())
    assert "float32" in msg and "bfloat16 is not native" in msg and "neither AVX512_BF16 nor AMX" in msg
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_float32_checkpoint_stays_float32(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    assert LLM(str(folder), **SMALL).engine.dtype == F32


def test_explicit_dtype_wins_over_auto(bf16_checkpoint, monkeypatch):
    monkeypatch.setattr(cpu_plugin, "native_bf16", lambda: (False, "no"))
    assert LLM(str(bf16_checkpoint), dtype="bfloat16", **SMALL).engine.dtype == BF16


@pytest.mark.skipif(not NATIVE_BF16, reason=f"no native bfloat16 here: {WHY_BF16}")
def test_default_model_runs_bf16_on_a_native_cpu():
    from polyrunner.models.default_model import default_model_path
    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    llm = LLM(**SMALL)
    assert llm.engine.dtype == BF16
    out = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
