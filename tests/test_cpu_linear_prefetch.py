"""Where the pool's bfloat16 linears prefetch their weights (`linear_prefetch.py`): chosen by the
times measured on this machine and cached, forced by `POLYRUNNER_CPU_LINEAR_PREFETCH`, reported by
the executor; and the level changes the kernels' speed only, never their output."""

from __future__ import annotations

import json

import pytest
import torch

from polyrunner.backends.cpu import kernel_table, kernels, linear_prefetch


@pytest.fixture
def native(monkeypatch):
    """The native build, the pool linears allowed, left at L1 (the kernels' default) afterwards."""
    for name in ("POLYRUNNER_CPU_DPBF16", "POLYRUNNER_CPU_AVX512", "POLYRUNNER_CPU_LINEAR"):
        monkeypatch.delenv(name, raising=False)
    with kernels.use_kernels("native") as lib:
        if lib is None:
            pytest.skip("no C++ compiler: the CPU kernel library is not built")
        yield lib
        lib.pr_set_linear_prefetch(0)


def _pool_kernel() -> str | None:
    return next((k for k in ("dpbf16", "avx512") if k in kernel_table.available()), None)


def test_level_is_chosen_by_the_cached_times(native, monkeypatch, tmp_path):
    """auto: the faster level on passes over weights beyond the caches, timed once, then read back
    from the table (where there is no AVX-512 linear: L1, nothing timed)."""
    monkeypatch.setenv("POLYRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("POLYRUNNER_CPU_LINEAR_PREFETCH", "auto")
    monkeypatch.setattr(kernel_table, "BUSY_LIMIT", float("inf"))
    monkeypatch.setattr(linear_prefetch, "LAYERS", 2)   # the timing's method, on less data
    line = linear_prefetch.choose(threads=2)
    kernel = _pool_kernel()
    if kernel is None:
        assert "into L1 (no AVX-512 linear here)" in line and not kernels.linear_prefetch_l2()
        assert not list(tmp_path.glob("cpu_kernels/kernel-table-*.json"))
        return
    table = json.loads(next(tmp_path.glob("cpu_kernels/kernel-table-*.json")).read_text())
    entry = table[f"linear prefetch {kernel}"]
    assert all(set(entry[level]) == {"1", "8"} for level in ("l1", "l2"))
    faster = min(("l1", "l2"), key=lambda level: sum(entry[level].values()))
    assert f"into {faster.upper()}" in line and kernels.linear_prefetch_l2() == (faster == "l2")

    def not_again(*args):
        raise AssertionError("timed again although the table holds the times")
    monkeypatch.setattr(linear_prefetch, "_time", not_again)
    kernels.set_linear_prefetch(faster == "l1")
    assert linear_prefetch.choose(threads=2) == line and kernels.linear_prefetch_l2() == (faster == "l2")


@pytest.mark.parametrize("level", ["l1", "l2"])
def test_forced_level_is_set_without_timing(native, monkeypatch, level):
    monkeypatch.setenv("POLYRUNNER_CPU_LINEAR_PREFETCH", level)
    monkeypatch.setattr(linear_prefetch, "_time", lambda *a: pytest.fail("timed although forced"))
    kernels.set_linear_prefetch(level == "l1")
    assert linear_prefetch.choose(threads=2) == \
        f"the pool's bfloat16 linears prefetch their weights into {level.upper()} (POLYRUNNER_CPU_LINEAR_PREFETCH)"
    assert kernels.linear_prefetch_l2() == (level == "l2")


@pytest.mark.parametrize("kernel", ["dpbf16", "avx512"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_level_changes_no_output(native, kernel, threads):
    """Both levels give bit-identical outputs: row counts within and beyond one register block,
    column groups of 4, 3, 2 and 1 blocks, one thread and the pool."""
    if kernel not in kernel_table.available():
        pytest.skip(f"no {kernel} linear here")
    kernels.start_pool(threads)
    try:
        g = torch.Generator().manual_seed(5)
        for N, K in [(1104, 576), (48, 130), (96, 64)]:   # 1104 = 17 groups of 64 + 16: a one-block group
            w = torch.randn(N, K, generator=g).to(torch.bfloat16)
            packed = kernel_table.pack(kernel, w, 1)
            run = kernel_table.runner(kernel)
            for M in (1, 5, 8, 64, 100):
                x = torch.randn(M, K, generator=g).to(torch.bfloat16)
                outs = []
                for l2 in (False, True, False):
                    kernels.set_linear_prefetch(l2)
                    outs.append(run(x, packed, N, None))
                assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (N, K, M)
                ref = (x.double() @ w.double().T)
                assert torch.allclose(outs[0].double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    finally:
        kernels.start_pool(1)
