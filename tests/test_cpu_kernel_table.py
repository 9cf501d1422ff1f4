"""The CPU backend's linear-kernel choice by measurement (`kernel_table.py`): the choice from
the times, the cached table, `POLYRUNNER_CPU_LINEAR`, and every kernel forced through the
selection against the exact product (each runs where this CPU has it)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from polyrunner.backends.cpu import kernel_table, kernels
from polyrunner.backends.cpu.packed_linear import PackedLinear, packing_supported
from tolerances import assert_linear_close

needs_packing = pytest.mark.skipif(not packing_supported(torch.bfloat16),
                                   reason="oneDNN bfloat16 packing unavailable on this CPU")


def _times(**per_kernel):
    """kernel -> {rows: us}, from `kernel=[(rows, us), ...]`."""
    return {k: dict(points) for k, points in per_kernel.items()}


@pytest.fixture(autouse=True)
def _auto(monkeypatch):
    """The measured choice, and a quiet machine as far as caching goes (a busy one: the last tests)."""
    monkeypatch.delenv("POLYRUNNER_CPU_LINEAR", raising=False)
    monkeypatch.setattr(kernel_table, "BUSY_LIMIT", float("inf"))


def test_plan_takes_the_fastest_per_row_count_with_pool_kernels_up_to_pool_steps():
    times = _times(amx=[(1, 50), (8, 50), (64, 90), (128, 150), (512, 500)],
                   dpbf16=[(1, 30), (8, 70), (64, 400), (128, None), (512, None)],
                   onednn=[(1, 20), (8, 20), (64, 60), (128, 100), (512, 600)])
    plan = kernel_table.plan(times, 600, ["amx", "dpbf16", "onednn"])
    assert len(plan) == 601
    assert plan[0] == plan[1] == "dpbf16"     # faster oneDNN ignored: decode steps stay on the pool
    assert plan[4] == "dpbf16"                # interpolated: dpbf16 ~47 us, amx 50
    assert plan[6] == "amx"                   # dpbf16 ~61 us, amx 50
    assert plan[64] == "amx"                  # oneDNN 60 < 90, but a pool step
    assert plan[65] == plan[128] == "onednn"  # above pool steps the fastest of all
    assert plan[512] == plan[600] == "amx"    # beyond the last row count: its choice
    assert kernel_table.pool_prefix(plan) == 64


def test_plan_without_a_pool_kernel_and_with_untimed_kernels():
    assert set(kernel_table.plan(_times(onednn=[(1, 5)]), 80, ["onednn"])) == {"onednn"}
    # a candidate never timed (not in the table) is not chosen; no pool kernel at all: pool prefix 0
    plan = kernel_table.plan(_times(onednn=[(1, 5), (64, 9)]), 64, ["dpbf16", "onednn"])
    assert set(plan) == {"onednn"} and kernel_table.pool_prefix(plan) == 0


def test_recheck_names_islands_crossovers_and_close_calls_among_the_competing_kernels():
    rows = [1, 2, 4, 8, 16, 32, 64, 128]
    times = _times(dpbf16=[(1, 50), (2, 52), (4, 60), (8, 70), (16, 100), (32, 300), (64, 400), (128, 800)],
                   avx512=[(1, 40), (2, 60), (4, 90), (8, 140), (16, 250), (32, 280), (64, 800), (128, None)],
                   onednn=[(1, 90), (2, 90), (4, 10), (8, 20), (16, 40), (32, 90), (64, 160), (128, 790)])
    again = kernel_table._recheck(times, rows)
    assert again[1] == again[2] == ["avx512", "dpbf16"]   # crossover 1 -> 2 (avx512, then dpbf16)
    assert 4 not in again and 8 not in again              # clear: oneDNN faster, but not a pool step
    assert again[16] == ["avx512", "dpbf16"]              # next to the island at 32
    assert again[32] == ["avx512", "dpbf16"]              # an island: avx512 between dpbf16 wins
    assert again[64] == ["avx512", "dpbf16"]              # next to it
    assert again[128] == ["dpbf16", "onednn"]             # above pool steps: all compete; within 10%


def test_measure_times_pool_kernels_apart_from_onednn_and_rechecks_what_a_burst_turned(monkeypatch):
    """A burst of load during dpbf16's first timing at 32 rows makes avx512 win there; the second look
    (a quieter moment) restores dpbf16. Up to `POOL_STEP_ROWS` rows oneDNN is never timed in the same
    turns as a pool kernel; above, all are (prefill steps run them side by side)."""
    cost = {"dpbf16": 1.0, "avx512": 1.5, "onednn": 0.8}   # ms per call at 32 rows, scaled by rows
    calls: dict[str, int] = {}   # per kernel and row count
    groups: list[set[str]] = []
    clock = [0.0]

    def fake_runner(name):
        def run(x, packed, N, bias):
            key = f"{name}@{x.shape[0]}"
            calls[key] = calls.get(key, 0) + 1
            burst = key == "dpbf16@32" and calls[key] <= 1 + kernel_table.REPEATS   # the first pass only
            clock[0] += cost[name] * x.shape[0] / 32 * (3.0 if burst else 1.0) / 1e3
        return run
    real_turns = kernel_table.time_in_turns

    def spy_turns(fns, per_call=None, repeats=kernel_table.REPEATS):
        groups.append(set(fns))
        return real_turns(fns, per_call, repeats)
    monkeypatch.setattr(kernel_table, "runner", fake_runner)
    monkeypatch.setattr(kernel_table, "pack", lambda kernel, w, hint: w)
    monkeypatch.setattr(kernel_table, "time_in_turns", spy_turns)
    monkeypatch.setattr(kernel_table.time, "perf_counter", lambda: clock[0])
    w = [torch.zeros(16, 32, dtype=torch.bfloat16)]
    out = kernel_table.measure(w, ["dpbf16", "avx512", "onednn"], [16, 32, 64, 128], 64)
    assert len(groups) >= 7, groups   # 3 row counts in two groups each, 128 in one, then the rechecks
    assert all(g <= kernel_table.POOL_KERNELS or g == {"onednn"} for g in groups[:6]), groups
    assert groups[6] == {"dpbf16", "avx512", "onednn"}
    assert out["dpbf16"][32] == pytest.approx(1000.0) and out["avx512"][32] == pytest.approx(1500.0)
    assert kernel_table.plan(out, 64, ["dpbf16", "avx512", "onednn"])[32] == "dpbf16"


def test_interpolate():
    points = {1: 10.0, 9: 30.0, 16: None}
    assert kernel_table.interpolate(points, 1) == 10.0
    assert kernel_table.interpolate(points, 5) == 20.0
    assert kernel_table.interpolate(points, 12) == float("inf")
    assert kernel_table.interpolate({1: 10.0, 4: 16.0}, 8) == 32.0   # above the last: proportional
    assert kernel_table.interpolate({}, 3) == float("inf")


def test_forced_kernel(monkeypatch):
    monkeypatch.setenv("POLYRUNNER_CPU_LINEAR", "onednn")
    times = _times(amx=[(1, 1)], dpbf16=[(1, 1)], onednn=[(1, 100)])
    assert set(kernel_table.plan(times, 10, ["amx", "dpbf16", "onednn"])) == {"onednn"}
    monkeypatch.setenv("POLYRUNNER_CPU_LINEAR", "amx")
    monkeypatch.setenv("POLYRUNNER_CPU_AMX", "0")
    with kernels.use_kernels("native"):
        with pytest.raises(ValueError, match="POLYRUNNER_CPU_LINEAR=amx: that kernel cannot run here"):
            kernel_table.forced()
    monkeypatch.setenv("POLYRUNNER_CPU_LINEAR", "fastest")
    with pytest.raises(ValueError, match="POLYRUNNER_CPU_LINEAR"):
        kernel_table.forced()


@needs_packing
def test_table_is_measured_once_then_read_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("POLYRUNNER_CACHE", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    weights = {(64, 96): [torch.randn(64, 96, generator=g).to(torch.bfloat16) for _ in range(3)]}
    first = kernel_table.linear_table(weights, 64, threads=1, rows_limit={(64, 96): 20})
    names = [k for k in kernel_table.available() if kernel_table.supports(k, (64, 96))]
    assert set(first[(64, 96)]) == set(names)
    assert all(set(t) == {1, 2, 4, 8, 16, 20} for t in first[(64, 96)].values())
    assert all(v is None or v > 0 for t in first[(64, 96)].values() for v in t.values())
    files = list((tmp_path / "cpu_kernels").glob("kernel-table-*.json"))
    assert len(files) == 1 and kernel_table.shape_key((64, 96), 64) in json.loads(files[0].read_text())

    def fail(*args, **kwargs):
        raise AssertionError("measured again")
    monkeypatch.setattr(kernel_table, "measure", fail)
    assert kernel_table.linear_table(weights, 64, threads=1, rows_limit={(64, 96): 20}) == first
    with pytest.raises(AssertionError, match="measured again"):   # another thread count: another table
        kernel_table.linear_table(weights, 64, threads=3, rows_limit={(64, 96): 20})
    assert kernel_table.table_key(1) != kernel_table.table_key(3)
    if kernels.paged_attention_kernel() is not None:   # times at the other prefetch level: timed again
        previous = kernels.set_linear_prefetch(not kernels.linear_prefetch_l2())
        try:
            with pytest.raises(AssertionError, match="measured again"):
                kernel_table.linear_table(weights, 64, threads=1, rows_limit={(64, 96): 20})
        finally:
            kernels.set_linear_prefetch(previous)


def _kernel_params():
    """Each kernel, skipped where this CPU (or build) cannot run it, and the measured choice."""
    reasons = {"amx": kernels.amx_unavailable_reason, "dpbf16": kernels.dpbf16_unavailable_reason,
               "avx512": kernels.avx512_unavailable_reason}
    out = []
    for name in kernel_table.LINEAR_KERNELS:
        why = reasons[name]() if name in reasons else None
        out.append(pytest.param(name, marks=pytest.mark.skipif(why is not None, reason=f"no {name}: {why}")))
    return out + ["auto"]


@needs_packing
@pytest.mark.parametrize("kernel", _kernel_params())
def test_each_kernel_through_the_selection_matches_the_exact_product(monkeypatch, tmp_path, kernel):
    """`POLYRUNNER_CPU_LINEAR=<kernel>` (or the measured choice) from `plans` to a PackedLinear's
    output, at decode and prefill row counts, strided input rows included."""
    monkeypatch.setenv("POLYRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("POLYRUNNER_CPU_LINEAR", kernel)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 128, generator=g) / 8).to(torch.bfloat16)
    plan = kernel_table.plans({(96, 128): [w]}, 64, threads=2, limit=kernel_table.ROWS[-1])[(96, 128)]
    assert len(plan) == kernel_table.ROWS[-1] + 1
    if kernel != "auto":
        assert set(plan) == {kernel}
    else:
        assert set(plan) <= set(kernel_table.available())
    lin = PackedLinear(w, None, 64, plan)
    assert {name.removeprefix("packed_") for name, _ in lin.named_buffers() if name.startswith("packed_")} == set(plan)
    for M in (1, 3, 17, 64, 100, 600):
        x = torch.randn(M, 256, generator=g).to(torch.bfloat16)[:, ::2]   # row stride 256, column stride 2
        assert_linear_close(lin(x), x, w, msg=f"{kernel} at {M} rows (plan: {plan[min(M, 512)]}): ")


def test_plan_aligned_to_graph_sizes_gives_a_step_its_padded_graph_kernel():
    """An eager step of 3 rows runs what the graph of 4 it pads to runs (kernels round differently)."""
    times = _times(amx=[(1, 50), (2, 50), (4, 40), (8, 10)], dpbf16=[(1, 10), (2, 10), (4, 50), (8, 50)])
    free = kernel_table.plan(times, 8, ["amx", "dpbf16"])
    aligned = kernel_table.plan(times, 8, ["amx", "dpbf16"], align=[1, 2, 4, 8])
    assert free[3] == "dpbf16" and aligned[3] == aligned[4] == "amx"
    assert aligned[1] == aligned[2] == "dpbf16" and aligned[5:] == ("amx",) * 4


def test_prefill_attention_variant_is_chosen_by_the_cached_times(monkeypatch, tmp_path):
    """auto: the faster variant on the timed prompt, read back from the table (AMX machines only:
    elsewhere there is one variant and nothing is timed)."""
    from polyrunner.backends.cpu import attention
    monkeypatch.setenv("POLYRUNNER_CACHE", str(tmp_path))
    monkeypatch.setenv("POLYRUNNER_CPU_PREFILL_ATTENTION", "auto")
    monkeypatch.setattr(attention, "_choice", {})
    with kernels.use_kernels("native"):
        q, cache = torch.zeros(4, 6, 64, dtype=torch.bfloat16), torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16)
        if not kernels.simd_bf16() or kernels.prefill_attention_amx_reason() is not None:
            assert attention.prefill_uses_amx(q, cache) is False
            assert not list(tmp_path.glob("cpu_kernels/kernel-table-*.json"))
            return
        chosen = attention.prefill_uses_amx(q, cache)
        table = json.loads(next(tmp_path.glob("cpu_kernels/kernel-table-*.json")).read_text())
        times = table["prefill attention 6/2x64 block 16"]
        assert chosen == (sum(times["amx"].values()) < sum(times["dpbf16"].values()))
        monkeypatch.setenv("POLYRUNNER_CPU_PREFILL_ATTENTION", "dpbf16")
        assert attention.prefill_uses_amx(q, cache) is False


def test_times_taken_under_load_are_kept_for_the_process_but_not_cached(monkeypatch, tmp_path, caplog):
    caplog.set_level("INFO", logger="polyrunner")
    monkeypatch.setenv("POLYRUNNER_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_table, "BUSY_LIMIT", 0.5)
    monkeypatch.setattr(kernel_table, "_unsaved", {})
    monkeypatch.setattr(kernel_table.threads_, "busy_elsewhere", lambda a, b: 1.7)
    calls = []

    def measure():
        calls.append(1)
        return {"a": {1: 5.0 * len(calls)}}
    assert kernel_table.cached("k", measure, threads=1) == {"a": {1: 5.0}}
    assert "other processes kept 1.7 cores busy: not cached" in caplog.text
    assert not list(tmp_path.glob("cpu_kernels/kernel-table-*.json"))
    # every engine of this process picks the same kernels: the times are reused, not taken again
    monkeypatch.setattr(kernel_table.threads_, "busy_elsewhere", lambda a, b: 0.1)
    assert kernel_table.cached("k", measure, threads=1) == {"a": {1: 5.0}} and len(calls) == 1
    monkeypatch.setattr(kernel_table, "_unsaved", {})   # the next start: timed again, quiet, cached
    assert kernel_table.cached("k", measure, threads=1) == {"a": {1: 10.0}} and len(calls) == 2
    assert list(tmp_path.glob("cpu_kernels/kernel-table-*.json"))
    assert kernel_table.cached("k", measure, threads=1) == {"a": {1: 10.0}} and len(calls) == 2


def test_busy_elsewhere_counts_other_processes_cores():
    from polyrunner.backends.cpu.threads import busy_elsewhere
    tick = 1 / os.sysconf("SC_CLK_TCK")
    # 4 busy CPU-s, 1 ours, over 2 s: 1.5 cores, less two ticks of counter rounding
    assert busy_elsewhere((0.0, 10.0, 1.0), (2.0, 14.0, 2.0)) == pytest.approx(1.5 - tick)
    assert busy_elsewhere((0.0, 10.0, 1.0), (0.03, 10.0 + 2 * tick, 1.0)) == 0.0   # two ticks in 30 ms: rounding
    assert busy_elsewhere(None, (1.0, 2.0, 3.0)) == 0.0
