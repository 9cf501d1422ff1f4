"""The conformance group `ops`: the CPU backend's op overrides pass it; a deliberately wrong
override (an RMSNorm without its weight) and an override for an unknown role fail it, naming the
role; a backend without overrides passes with a note."""

from __future__ import annotations

import torch
from torch import nn

from polyrunner.backends.cpu.packed_linear import packing_supported
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.tools.conformance import run_conformance

CHECK = "ops::overrides_match_reference"


class RMSNormWithoutWeight(nn.Module):
    """Bug: normalises but never scales by the weight."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)

    def forward_add(self, x, residual):
        residual = x + residual
        return self(residual), residual


class WeightlessNormBackend(CPUBackend):
    name = "broken_rms_norm_override"
    priority = -100

    def op_overrides(self, dtype):
        return {**super().op_overrides(dtype), "rms_norm": RMSNormWithoutWeight}


class UnknownRoleBackend(CPUBackend):
    name = "broken_unknown_role_override"
    priority = -100

    def op_overrides(self, dtype):
        return {"layer_norm": lambda module: module}


class NoOverridesBackend(CPUBackend):
    name = "no_op_overrides"
    priority = -100

    def op_overrides(self, dtype):
        return {}


def test_the_cpu_backends_overrides_pass():
    report = run_conformance("cpu", groups=["ops"])
    assert report.passed, report.failures()
    note = report.get(CHECK).detail
    # float32: the fused norms, rotary and MLP and the native LoRA ops; bfloat16: every role; float16: none
    assert note.startswith("float32: rms_norm 5/5, rotary 2/2, gated_mlp 3/3, lora 9/9, lora_embedding 3/3 cases "
                           "replaced"), note
    assert "no op overrides for float16" in note, note
    if packing_supported(torch.bfloat16):
        assert "bfloat16: linear 6/6" in note and "lora 9/9" in note.split("bfloat16:")[1], note


def test_an_rms_norm_without_its_weight_fails_naming_the_role(registered):
    report = run_conformance(registered(WeightlessNormBackend), groups=["ops"])
    result = report.get(CHECK)
    assert result.outcome == "failed", result
    assert result.detail.startswith("op override for role 'rms_norm' (forward, float32, 1x64) differs from the "
                                    "reference: max abs error"), result.detail


def test_an_unknown_role_fails_naming_it(registered):
    result = run_conformance(registered(UnknownRoleBackend), groups=["ops"]).get(CHECK)
    assert result.outcome == "failed" and "unknown role(s) 'layer_norm'" in result.detail, result


def test_a_backend_without_overrides_passes_with_a_note(registered):
    result = run_conformance(registered(NoOverridesBackend), groups=["ops"]).get(CHECK)
    assert result.outcome == "passed" and result.detail == "no op overrides for float32, bfloat16, float16", result
