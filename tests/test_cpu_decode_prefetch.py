"""Where the bfloat16 decode attention prefetches the next KV block (`decode_prefetch.py`): chosen by
the times measured on this machine and cached, forced by `POLYRUNNER_CPU_DECODE_PREFETCH`, reported
by the executor; and the level changes the kernel's speed only, never its output."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from polyrunner.backends.cpu import decode_prefetch, kernel_table, kernels
from polyrunner.plugin_api import LayerSpec
from test_cpu_decode_kernels import _decode_batch

SPEC = LayerSpec(9, 3, 64, 0.125, None)


@pytest.fixture(autouse=True)
def _restore_level():
    """Leave the library as the test found it (L1: the kernel's default)."""
    yield
    for variant in ("native", "portable"):
        lib = kernels.load_library(variant)
        if lib is not None:
            lib.pr_set_decode_prefetch(0)


def _level(lib) -> int:
    previous = lib.pr_set_decode_prefetch(0)
    lib.pr_set_decode_prefetch(previous)
    return previous


def test_level_is_chosen_by_the_cached_times(monkeypatch, tmp_path):
    """auto: the faster level on streamed decode steps, timed once, then read back from the table
    (where there is no AVX512_BF16 decode kernel: L1, nothing timed)."""
    monkeypatch.setenv("POLYRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("POLYRUNNER_CPU_DECODE_PREFETCH", "auto")
    monkeypatch.setattr(kernel_table, "BUSY_LIMIT", float("inf"))
    with kernels.use_kernels("native") as lib:
        if lib is None:
            pytest.skip("no C++ compiler: the CPU kernel library is not built")
        line = decode_prefetch.choose(SPEC, 16, threads=2)
        if not kernels.simd_bf16():
            assert "into L1" in line and _level(lib) == 0
            assert not list(tmp_path.glob("cpu_kernels/kernel-table-*.json"))
            return
        table = json.loads(next(tmp_path.glob("cpu_kernels/kernel-table-*.json")).read_text())
        times = {name: sum(t.values()) for name, t in table["decode prefetch 9/3x64 block 16"].items()}
        faster = min(("l1", "l2"), key=times.__getitem__)
        assert f"into {faster.upper()}" in line and _level(lib) == (faster == "l2")

        def not_again(*args):
            raise AssertionError("timed again although the table holds the times")
        monkeypatch.setattr(decode_prefetch, "_time", not_again)
        lib.pr_set_decode_prefetch(int(faster == "l1"))
        assert decode_prefetch.choose(SPEC, 16, threads=2) == line and _level(lib) == (faster == "l2")


@pytest.mark.parametrize("level", ["l1", "l2"])
def test_forced_level_is_set_without_timing(monkeypatch, level):
    monkeypatch.setenv("POLYRUNNER_CPU_DECODE_PREFETCH", level)
    monkeypatch.setattr(decode_prefetch, "_time", lambda *a: pytest.fail("timed although forced"))
    with kernels.use_kernels("native") as lib:
        if lib is None:
            pytest.skip("no C++ compiler: the CPU kernel library is not built")
        lib.pr_set_decode_prefetch(int(level == "l1"))
        assert decode_prefetch.choose(SPEC, 16, threads=2) == \
            f"decode attention prefetches into {level.upper()} (POLYRUNNER_CPU_DECODE_PREFETCH)"
        assert _level(lib) == (level == "l2")


def test_the_level_changes_no_output(cpu_kernels, pool_threads):
    """Both levels give bit-identical decode outputs (scattered blocks, contexts split and merged)."""
    from polyrunner.backends.cpu.attention import cpu_paged_attention
    rng = np.random.default_rng(3)
    g = torch.Generator().manual_seed(3)
    ctx = [700, 5, 300, 64, 1000, 33]
    num_blocks = sum(-(-L // 16) for L in ctx) + 8
    meta = _decode_batch(rng, ctx, 16, num_blocks)
    q = torch.randn(len(ctx), 9, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(len(ctx), 3, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    cache = torch.randn(2, num_blocks, 16, 3, 64, generator=g).to(torch.bfloat16)
    outs = []
    for l2 in (False, True, False):
        cpu_kernels.pr_set_decode_prefetch(int(l2))
        outs.append(cpu_paged_attention(q, k, v, cache.clone(), meta, SPEC))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert bool(outs[0].abs().sum() > 0)
