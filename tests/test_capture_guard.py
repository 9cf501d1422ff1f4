"""The capture guard (core/device/capture_guard.py) and the MoE reference's fixed-shape path.

- every host sync the guard names is refused with `HostSyncError` on an emulated device (the
  CPU), and on a "real" one (the meta device stands in: CPU tensors are host data there);
- what a step may do passes: fixed-shape ops, reads of declared host data (and of what is
  computed from it alone), views, allocations on the step's device;
- `in_static_step()` is True inside a guard and under torch.compile, False outside;
- the MoE reference inside a guard takes `static_fused_experts`, which equals the grouped path,
  and the grouped path (its `bincount(...).tolist()`) is refused there.
"""

from __future__ import annotations

import pytest
import torch

from polyrunner.device.capture_guard import HostSyncError, capture_guard, host_tensor, in_static_step
from polyrunner.ops import moe
from polyrunner.ops.moe import fused_experts, select_experts, static_fused_experts

X = torch.arange(12.0).reshape(3, 4)
IDX = torch.tensor([0, 2, 2, 1])

REFUSED = {
    "item": lambda: X[0, 0].item(),
    "tolist": lambda: X.tolist(),
    "numpy": lambda: X.numpy(),
    "cpu": lambda: X.cpu(),
    "bool": lambda: bool(X[0, 1]),
    "int": lambda: int(X[0, 1]),
    "float": lambda: float(X[0, 1]),
    "nonzero": lambda: torch.nonzero(X),
    "argwhere": lambda: torch.argwhere(X),
    "bincount": lambda: torch.bincount(IDX, minlength=8),
    "unique": lambda: torch.unique(IDX),
    "unique_consecutive": lambda: torch.unique_consecutive(IDX),
    "masked_select": lambda: torch.masked_select(X, X > 3),
    "bool_mask_index": lambda: X[X > 3],
    "bool_mask_index_put": lambda: X.clone().index_put_((X > 3,), torch.tensor(0.0)),
    "repeat_interleave": lambda: torch.repeat_interleave(IDX),
    "pinned_alloc": lambda: torch.empty(4, pin_memory=True),
    "upload": lambda: torch.zeros(4).copy_(host_tensor(torch.ones(4))),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_host_syncs_on_an_emulated_device(name):
    with pytest.raises(HostSyncError, match="inside a captured or compiled step"):
        with capture_guard("cpu"):
            REFUSED[name]()


@pytest.mark.parametrize("name", ["item", "tolist", "nonzero", "bincount", "bool_mask_index"])
def test_the_same_ops_run_outside_a_guard(name):
    if name != "pinned_alloc":
        REFUSED[name]()


def test_allowed_inside_a_guard():
    with capture_guard("cpu"):
        y = (X @ X.t()).softmax(-1)                      # fixed-shape device work
        y = y[1:, :2].reshape(-1).contiguous()           # views
        torch.zeros(3).scatter_(0, torch.tensor([0, 2]), torch.tensor([1.0, 2.0]))
        torch.repeat_interleave(IDX, IDX, output_size=5)  # output size given: no read
        torch.where(X > 3, X, 0.0)
        lens = host_tensor(torch.tensor([3, 1, 4]))
        assert lens.tolist() == [3, 1, 4] and int(lens[2]) == 4   # host data, and what it computes
        assert (lens + 1).max().item() == 5
    assert y.shape == (4,)


def test_host_marks_are_per_tensor():
    lens = host_tensor(torch.tensor([3, 1]))
    with pytest.raises(HostSyncError):
        with capture_guard("cpu"):
            (lens + X[0, :2].long()).tolist()   # mixed with device data: a device value


def test_real_device_rules():
    """On a real device CPU tensors are host data; reads and downloads of device tensors are refused."""
    dev = torch.device("meta")
    x = torch.ones(4, device=dev)
    with capture_guard(dev):
        host = torch.arange(4)
        assert host.tolist() == [0, 1, 2, 3] and host.sum().item() == 6
        (x * 2).reshape(2, 2)
    for refused in (lambda: x.tolist(), lambda: x.to("cpu"), lambda: x.cpu(), lambda: torch.arange(4).to(dev),
                    lambda: torch.empty(4, device=dev).copy_(torch.arange(4.0))):
        with pytest.raises(HostSyncError):
            with capture_guard(dev):
                refused()


def test_in_static_step():
    assert not in_static_step()
    with capture_guard("cpu"):
        assert in_static_step()
        with capture_guard("cpu"):
            assert in_static_step()
        assert in_static_step()
    assert not in_static_step()
    seen = []

    def f(x):
        seen.append(in_static_step())
        return x + 1

    torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    assert seen == [True]


def test_guard_state_survives_an_error():
    with pytest.raises(HostSyncError):
        with capture_guard("cpu"):
            X.tolist()
    assert not in_static_step()
    X.tolist()


# ---- the MoE reference in a captured step ----------------------------------------------------
@pytest.mark.parametrize("tokens,experts,top_k,renormalize,dtype", [
    (1, 4, 2, True, torch.float32), (7, 8, 2, False, torch.float32), (5, 4, 1, True, torch.float32),
    (16, 4, 4, True, torch.float32), (9, 8, 2, True, torch.bfloat16)])
def test_static_experts_equal_the_grouped_path(tokens, experts, top_k, renormalize, dtype):
    g = torch.Generator().manual_seed(tokens * experts + top_k)
    H, inter = 32, 16
    x = torch.randn(tokens, H, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, H, inter, generator=g) * 0.2).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 0] -= 100   # expert 0 receives no token
    weights, ids = select_experts(logits, top_k, renormalize)
    grouped = fused_experts(x, w13, w2, weights, ids)
    static = static_fused_experts(x, w13, w2, weights, ids)
    with capture_guard("cpu"):
        guarded = fused_experts(x, w13, w2, weights, ids)
    assert torch.equal(guarded, static)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static, grouped, **tol)
    wrong = static_fused_experts(x, w13, w2, weights, (ids + 1) % experts)
    assert not torch.allclose(wrong.float(), grouped.float(), **tol)   # the comparison can fail


def test_static_experts_ignore_overflow_off_the_route():
    """A non-routed expert whose output overflows contributes 0, not 0 * inf = NaN."""
    x = torch.ones(2, 4)
    w13 = torch.zeros(2, 4, 4)
    w2 = torch.zeros(2, 4, 2)
    w13[1] = 1e30   # expert 1 overflows; every token is routed to expert 0 only
    w2[1] = 1e30
    w13[0, :2] = 0.5
    w2[0] = 1.0
    out = static_fused_experts(x, w13, w2, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, fused_experts(x, w13, w2, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)))


def test_grouped_path_is_refused_in_a_captured_step(monkeypatch):
    """What the static path is for: the grouped path reads per-expert counts on the host."""
    x, w13, w2 = torch.randn(3, 8), torch.randn(4, 8, 8), torch.randn(4, 8, 4)
    weights, ids = select_experts(torch.randn(3, 4), 2, True)
    monkeypatch.setattr(moe, "in_static_step", lambda: False)
    with pytest.raises(HostSyncError, match="bincount"):
        with capture_guard("cpu"):
            fused_experts(x, w13, w2, weights, ids)
