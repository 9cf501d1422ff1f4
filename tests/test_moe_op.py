"""The "moe" role's reference (`polyrunner.ops.moe`): `select_experts` is softmax (or sigmoid)
top-k with optional renormalisation; `fused_experts` / `FusedMoE` equal a dense per-token
computation (every expert on every token, then the chosen ones weighted) on random routings,
including experts that receive no token and top_k == E; the conformance `ops` group passes an
override that computes the same and fails one that forgets the renormalisation, naming the role."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.ops import MODULE_ROLES, ROLES, FusedMoE, apply_overrides, fused_experts, select_experts
from polyrunner.ops.cases import CaseSizes, moe_cases
from polyrunner.tools.conformance import run_conformance


def _dense_reference(x, w13, w2, weights, ids):
    """Every expert on every token (float64), then each token's chosen experts weighted and summed."""
    x64, w13, w2 = x.double(), w13.double(), w2.double()
    gate_up = torch.einsum("th,eih->tei", x64, w13)
    gate, up = gate_up.chunk(2, dim=-1)
    per_expert = torch.einsum("tei,ehi->teh", F.silu(gate) * up, w2)           # [T, E, H]
    chosen = per_expert.gather(1, ids.long().unsqueeze(-1).expand(-1, -1, x.shape[-1]))   # [T, k, H]
    return (chosen * weights.double().unsqueeze(-1)).sum(1)


def _weights(gen, experts, hidden, inter):
    return (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5,
            torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5)


@pytest.mark.parametrize("tokens,experts,top_k,used", [
    (1, 4, 1, 4), (7, 8, 2, 3), (37, 8, 2, 8), (13, 6, 6, 6), (0, 4, 2, 4), (29, 16, 4, 5)])
def test_fused_experts_equals_the_dense_per_token_computation(tokens, experts, top_k, used):
    """Routings over the first `used` experts only (the rest receive no token); top_k == E routes
    every token to every expert."""
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden, inter = 24, 40
    x = torch.randn(tokens, hidden, generator=gen)
    w13, w2 = _weights(gen, experts, hidden, inter)
    ids = torch.rand(tokens, used, generator=gen).argsort(dim=-1)[:, :top_k].to(torch.int32)   # distinct per token
    weights = torch.rand(tokens, top_k, generator=gen)
    got = fused_experts(x, w13, w2, weights, ids)
    assert got.shape == (tokens, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _dense_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_fused_experts_keeps_the_input_dtype():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 32, generator=gen)
    w13, w2 = _weights(gen, 4, 32, 16)
    weights, ids = select_experts(torch.randn(9, 4, generator=gen), 2, True)
    got = fused_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16
    ref = _dense_reference(x, w13, w2, weights, ids)
    assert (got.double() - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_softmax_top_k(renormalize):
    gen = torch.Generator().manual_seed(int(renormalize))
    logits = torch.randn(11, 8, generator=gen).bfloat16()
    weights, ids = select_experts(logits, 3, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (11, 3)
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(ids.long(), probs.topk(3, dim=-1).indices)
    chosen = probs.gather(1, ids.long())
    want = chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen
    torch.testing.assert_close(weights, want)
    assert torch.allclose(weights.sum(-1), torch.ones(11)) == renormalize


def test_select_experts_sigmoid_scoring():
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(9))
    weights, ids = select_experts(logits, 2, False, scoring="sigmoid")
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, ids.long()))
    assert torch.equal(ids.long(), logits.topk(2, dim=-1).indices)


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_top_k_outside_the_experts_is_refused_naming_the_range(top_k):
    with pytest.raises(ValueError, match=rf"top_k must be in \[1, 4\] \(the number of experts\), got {top_k}"):
        select_experts(torch.zeros(2, 4), top_k, True)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\]"):
        FusedMoE(4, top_k, 8, 8)


def test_an_unknown_scoring_is_refused():
    with pytest.raises(ValueError, match=r"scoring must be one of \('softmax', 'sigmoid'\), got 'relu'"):
        FusedMoE(4, 2, 8, 8, scoring="relu")


@pytest.mark.parametrize("renormalize,scoring", [(True, "softmax"), (False, "softmax"), (False, "sigmoid")])
def test_fused_moe_routes_then_runs_the_experts(renormalize, scoring):
    gen = torch.Generator().manual_seed(5)
    moe = FusedMoE(8, 2, 32, 24, renormalize, scoring)
    moe.w13_weight.data, moe.w2_weight.data = _weights(gen, 8, 32, 24)
    x, logits = torch.randn(17, 32, generator=gen), torch.randn(17, 8, generator=gen)
    weights, ids = select_experts(logits, 2, renormalize, scoring)
    torch.testing.assert_close(moe(x, logits).double(), _dense_reference(x, moe.w13_weight, moe.w2_weight, weights,
                                                                         ids), rtol=1e-5, atol=1e-5)


def test_the_moe_role_is_in_the_table_and_its_cases_cover_empty_and_full_routing():
    assert "moe" in MODULE_ROLES and ROLES["moe"].reference is FusedMoE
    cases = list(moe_cases(torch.float32, torch.device("cpu"), CaseSizes(), torch.Generator().manual_seed(0)))
    assert len(cases) == 2 * len(CaseSizes().hidden)
    shapes = {(c.module.num_experts, c.module.top_k) for c in cases}
    assert shapes == {(8, 2), (4, 4)}
    seen = torch.zeros(8, dtype=torch.long)
    for case in cases:
        if case.module.top_k == 2:
            for call in case.calls:
                captured = {}

                def spy(m, args, captured=captured):
                    logits = args[1]
                    captured["ids"] = select_experts(logits, m.top_k, m.renormalize, m.scoring)[1]
                handle = case.module.register_forward_pre_hook(spy)
                call.run(case.module)
                handle.remove()
                seen += torch.bincount(captured["ids"].flatten().long(), minlength=8)
    assert seen[-1] == 0 and (seen[:-1] > 0).all()   # the last expert never receives a token


class DenseMoE(nn.Module):
    """A correct "moe" override: every expert on every token, the chosen ones weighted."""

    def __init__(self, moe: nn.Module, renormalize: bool | None = None) -> None:
        super().__init__()
        self.inner = moe
        self.renormalize = moe.renormalize if renormalize is None else renormalize

    def forward(self, x, router_logits):
        m = self.inner
        weights, ids = select_experts(router_logits, m.top_k, self.renormalize, m.scoring)
        return _dense_reference(x, m.w13_weight, m.w2_weight, weights, ids).to(x.dtype)


class DenseMoEBackend(CPUBackend):
    name = "dense_moe_override"
    priority = -100

    def op_overrides(self, dtype):
        return {"moe": DenseMoE}


class NoRenormalizeBackend(CPUBackend):
    name = "moe_override_without_renormalize"
    priority = -100

    def op_overrides(self, dtype):
        return {"moe": lambda moe: DenseMoE(moe, renormalize=False)}


def test_the_conformance_ops_group_checks_a_moe_override(registered):
    result = run_conformance(registered(DenseMoEBackend), groups=["ops"]).get("ops::overrides_match_reference")
    assert result.outcome == "passed", result
    assert "float32: moe 6/6 cases replaced" in result.detail, result.detail
    broken = run_conformance(registered(NoRenormalizeBackend), groups=["ops"]).get("ops::overrides_match_reference")
    assert broken.outcome == "failed", broken
    assert broken.detail.startswith("op override for role 'moe' (forward, float32, 1x64) differs from the "
                                    "reference"), broken.detail


def test_apply_overrides_replaces_the_experts_of_a_sparse_block():
    from polyrunner.models.moe_arch import MoEArch
    from polyrunner.models.moe_block import SparseMoeBlock

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = SparseMoeBlock(16, MoEArch(4, 2, 8, True, (True,)), 8, 0)

        def replaceable_modules(self):
            yield "moe", self.block, "experts", self.block.experts

    model = Holder()
    assert apply_overrides(model, {"moe": DenseMoE}) == {"moe": 1}
    assert isinstance(model.block.experts, DenseMoE)
