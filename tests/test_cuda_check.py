"""benchmarks/cuda_check.py gives a verdict: exit 0 when every GPU phase skips for want of a GPU
(run here, in a subprocess), exit 1 when a phase errors, times out, is skipped for another reason
or misses a target (its `main()` run with a GPU claimed and the phase table replaced), and the
pieces its targets rest on (tie-excused token comparison, FULL-mode eager count, ms/step) judge
what they are given."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cuda_check as cc  # noqa: E402


# ---- the script on this machine --------------------------------------------------------
def test_without_a_gpu_every_gpu_phase_skips_and_it_exits_0(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run its GPU phases")
    record = tmp_path / "out" / "record.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_check.py"), "--wheels",
                           str(tmp_path / "no-wheels"), "--json", str(record)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert json.loads(record.read_text()) == summary
    assert lines[-2] == summary["verdict"]["line"] and lines[-2].startswith("cuda_check: NO GPU")
    gpu_phases = [p.name for p in cc.PHASES if p.needs_gpu]
    assert gpu_phases and all(summary[name] == {"skipped": cc.NO_GPU} for name in gpu_phases)
    assert "error" not in summary["env"] and summary["setup"]["missing"] == []
    assert summary["targets"] == cc.TARGETS and lines[0] == "cuda_check targets:"


# ---- the verdict, with a GPU claimed and fake phases -------------------------------------
def ok_phase(args, ctx):
    return {"figure": 1, "checks": {"graphs_speedup": cc.check(True, "6.0x")}}


def missing_phase(args, ctx):
    return {"figure": 1, "checks": {"graphs_speedup": cc.check(False, "2.1x (target >= 5x)")}}


def silent_phase(args, ctx):
    return {"figure": 1}   # declares a target, reports none


def raising_phase(args, ctx):
    raise RuntimeError("kernel launch failed")


def slow_phase(args, ctx):
    time.sleep(5)
    return ok_phase(args, ctx)


@pytest.fixture
def gpu_claimed(monkeypatch, tmp_path):
    """`cuda_check` believing a GPU is present, its set-up a no-op; `run(phases, *argv)` ->
    (exit status, the JSON record)."""
    monkeypatch.setattr(cc, "cuda_available", lambda: True)
    setup: dict = {"missing": []}
    monkeypatch.setattr(cc, "prepare", lambda wheels, site: dict(setup))

    def run(phases, *argv, missing=()):
        setup["missing"] = list(missing)
        monkeypatch.setattr(cc, "PHASES", phases)
        out = tmp_path / "record.json"
        rc = cc.main([*argv, "--json", str(out)])
        return rc, json.loads(out.read_text())
    return run


def fake(name, fn, budget=10, targets=("graphs_speedup",)):
    return cc.Phase(name, budget, fn, targets)


def test_all_targets_met_passes(gpu_claimed, capsys):
    rc, record = gpu_claimed([fake("a", ok_phase), fake("b", ok_phase)])
    assert rc == 0 and record["verdict"]["result"] == "PASS" and record["verdict"]["failures"] == []
    assert "cuda_check: PASS\n" in capsys.readouterr().out


@pytest.mark.parametrize("fn, budget, expected", [
    (raising_phase, 10, "bad: RuntimeError: kernel launch failed"),
    (missing_phase, 10, "bad: graphs_speedup missed (2.1x (target >= 5x))"),
    (silent_phase, 10, "bad: graphs_speedup not reported"),
    (slow_phase, 1, "bad: PhaseTimeout: phase exceeded 1s"),
])
def test_an_error_or_a_missed_target_fails(gpu_claimed, capsys, fn, budget, expected):
    rc, record = gpu_claimed([fake("good", ok_phase), fake("bad", fn, budget)])
    assert rc == 1 and record["verdict"]["result"] == "FAIL" and record["verdict"]["failures"] == [expected]
    assert "checks" in record["good"] and record["verdict"]["line"] == f"cuda_check: FAIL ({expected})"
    assert record["verdict"]["line"] in capsys.readouterr().out


def test_a_phase_skipped_by_the_deadline_fails(gpu_claimed):
    rc, record = gpu_claimed([fake("a", ok_phase), fake("b", ok_phase)], "--deadline", "20")
    assert rc == 1 and record["verdict"]["failures"] == ["a, b: skipped (global deadline)"]


def test_a_missing_import_with_a_gpu_fails(gpu_claimed):
    rc, record = gpu_claimed([fake("a", ok_phase)], missing=["gguf (ModuleNotFoundError: no gguf)"])
    assert rc == 1 and record["a"] == {"skipped": "setup: cannot import gguf"}
    assert record["verdict"]["failures"] == ["setup: cannot import gguf", "a: skipped (setup: cannot import gguf)"]


def test_skip_is_named_in_the_verdict_with_the_targets_it_leaves_unchecked(gpu_claimed):
    rc, record = gpu_claimed([fake("a", ok_phase), fake("b", missing_phase)], "--skip", "b")
    assert rc == 0 and record["b"] == {"skipped": "--skip"}
    assert record["verdict"]["line"] == "cuda_check: PASS (skipped by --skip: b [graphs_speedup])"


def test_an_unknown_skip_is_refused(gpu_claimed):
    with pytest.raises(SystemExit) as exc:
        gpu_claimed([fake("a", ok_phase)], "--skip", "nosuchphase")
    assert exc.value.code == 2


def test_no_gpu_skips_do_not_fail_but_other_failures_do():
    phases = [cc.Phase("env", 1, ok_phase, needs_gpu=False), fake("g", ok_phase)]
    no_gpu = {"setup": {"missing": []}, "env": {"checks": {}}, "g": {"skipped": cc.NO_GPU}}
    assert cc.verdict(no_gpu, phases, gpu=False)["result"] == "NO GPU"
    env_failed = no_gpu | {"env": {"error": "ImportError: x"}}
    assert cc.verdict(env_failed, phases, gpu=False)["failures"] == ["env: ImportError: x"]
    # with a GPU present, "no CUDA device" is not an excuse
    assert cc.verdict(no_gpu, phases, gpu=True)["failures"] == [f"g: skipped ({cc.NO_GPU})"]


# ---- what the targets rest on -----------------------------------------------------------
REF = cc.Reference(tokens=[[5, 6, 7, 8], [1, 2, 3, 4]], gaps=[[1.0, 0.0004, 2.0, 2.0], [1.0, 1.0, 0.5, 1.0]])


def test_tokens_identical_pass():
    r = cc.compare_tokens(REF, [[5, 6, 7, 8], [1, 2, 3, 4]], 1e-3)
    assert r["ok"] and r["compared"] == 8 and not r["excused"] and not r["mismatches"]


def test_a_divergence_at_a_near_tie_is_excused_and_ends_the_comparison():
    r = cc.compare_tokens(REF, [[5, 9, 0, 0], [1, 2, 3, 4]], 1e-3)   # later tokens differ: not counted
    assert r["ok"] and r["compared"] == 2 + 4
    assert r["excused"] == [{"prompt": 0, "token": 1, "gap": 0.0004, "cpu": 6, "gpu": 9}]


def test_a_divergence_beyond_the_margin_fails():
    r = cc.compare_tokens(REF, [[5, 6, 7, 8], [1, 2, 9, 4]], 1e-3)
    assert not r["ok"] and r["mismatches"] == [{"prompt": 1, "token": 2, "gap": 0.5, "cpu": 3, "gpu": 9}]
    assert cc.compare_tokens(REF, [[5, 6, 7, 8], [1, 2, 9, 4]], 0.5)["ok"]   # at the margin: a tie
    assert not cc.compare_tokens(REF, [[5, 6, 7], [1, 2, 3, 4]], 1e-3)["ok"]   # a shorter sequence


def test_top2_gap_reads_the_two_best_logprobs():
    lp = SimpleNamespace
    assert cc.top2_gap({3: lp(logprob=-1.0), 7: lp(logprob=-1.25)}) == pytest.approx(0.25)
    assert cc.top2_gap({3: lp(logprob=-3.0), 7: lp(logprob=-1.0), 9: lp(logprob=-1.5)}) == pytest.approx(0.5)


def test_full_mode_counts_every_eager_step():
    before = {"mode": "FULL", "replays": 4, "mixed_replays": 1, "eager": {"too_large": 2}}
    clean = cc.counter_delta(before, {"mode": "FULL", "replays": 40, "mixed_replays": 9, "eager": {"too_large": 2}})
    assert clean == {"mode": "FULL", "replays": 36, "mixed_replays": 8, "eager": {}}
    assert cc.full_mode_check(clean, None)["ok"]
    eager = cc.counter_delta(before, {"mode": "FULL", "replays": 40, "mixed_replays": 9, "eager": {"too_large": 3}})
    assert not cc.full_mode_check(eager, None)["ok"]
    fell_back = clean | {"mode": "FULL_DECODE_ONLY"}
    assert "needs a length-adaptive" in cc.full_mode_check(fell_back, "needs a length-adaptive attention")["detail"]
    assert not cc.full_mode_check(clean | {"mixed_replays": 0}, None)["ok"]


def test_the_tiny_phase_on_the_cpu_backend_checks_tokens_and_catches_eager_steps(monkeypatch, tmp_path):
    """The real phase with the CPU backend standing in for CUDA: tokens equal (CPU vs CPU), and
    the CPU backend captures no graphs, so its "FULL" run runs every step eagerly: a miss."""
    monkeypatch.setattr(cc, "GPU_BACKEND", "cpu")
    out = cc.phase_tiny(argparse.Namespace(model=None), {"tmp": str(tmp_path)})
    assert out["checks"]["tokens"]["ok"], out["checks"]["tokens"]
    assert all(r["compared"] == 12 * 24 for r in out["vs_cpu"].values())
    full = out["checks"]["full_no_eager"]
    assert not full["ok"] and "mode FULL_DECODE_ONLY" in full["detail"] and "no_graphs" in full["detail"]


def test_a_non_positive_decode_time_is_an_error(monkeypatch):
    times = iter([0.5, 0.4])   # the 1-token call slower than the 33-token one
    monkeypatch.setattr(cc, "generate", lambda llm, prompts, n: ([], next(times)))
    with pytest.raises(cc.MeasurementError, match="non-positive decode time"):
        cc.ms_per_step(None, [], 32)
    times = iter([0.5, 0.82])
    assert cc.ms_per_step(None, [], 32) == 10.0
