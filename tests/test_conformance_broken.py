"""The conformance suite must be able to fail: deliberately broken backends,
registered at run time, are each caught by the check group that targets them
(and the healthy CPU backend passes, through the CLI); a failed prerequisite
marks the checks that depend on it "blocked by <check>" instead of erroring them."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from backend_plugin import BackendPlugin
from polyrunner.attention.reference import reference_paged_attention, write_kv
from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.device.backend import Availability, Capabilities, GraphExecutor
from polyrunner.device.buckets import BucketPolicy, exponential_sizes
from polyrunner.tools.conformance import run_conformance


def _padded_policy(config) -> BucketPolicy:
    s = config.scheduler
    return BucketPolicy(exponential_sizes(1, s.max_num_batched_tokens), list(range(1, s.max_num_seqs + 1)))


# ---- broken backends ---------------------------------------------------------------
class TooSmallBucketPolicy(BucketPolicy):
    def pad(self, num_tokens, num_reqs):
        """Bug: the largest bucket *below* n (bisect the wrong way)."""
        tokens = max([b for b in self.token_buckets if b <= num_tokens], default=self.token_buckets[0])
        reqs = max([b for b in self.request_buckets if b <= num_reqs], default=self.request_buckets[0])
        return tokens, reqs


class TooSmallBucketBackend(CPUBackend):
    name = "broken_small_bucket"
    priority = -100

    def bucket_policy(self):
        p = _padded_policy(self.config)
        return TooSmallBucketPolicy(p.token_buckets, p.request_buckets)


class ShortBucketsBackend(CPUBackend):
    """Bug: a static-shape backend whose token buckets stop at half of
    max_num_batched_tokens, so pad() raises for every larger batch."""

    name = "broken_short_buckets"
    priority = -100
    capabilities = Capabilities(graph_mode="eager", static_shapes=True)

    def bucket_policy(self):
        s = self.config.scheduler
        return BucketPolicy(exponential_sizes(1, max(1, s.max_num_batched_tokens // 2)),
                            list(range(1, s.max_num_seqs + 1)))


SHORT_BUCKETS_PLUGIN = BackendPlugin(ShortBucketsBackend)   # for --conformance-plugin in a subprocess


class WrongShapeKVBackend(CPUBackend):
    name = "broken_kv_shape"
    priority = -100

    def allocate_kv_cache(self, spec, num_blocks):
        """Bug: block axis first, K/V axis second."""
        return [torch.zeros(num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size, dtype=spec.dtype)
                for _ in range(spec.num_layers)]


def _slots_from_tables(q, k, v, kv_cache, meta, spec):
    """Bug: derives slots from block tables and positions instead of slot_mapping,
    so padded tokens (request 0, position 0) overwrite request 0's first block."""
    bs = kv_cache.shape[2]
    req, pos = meta.token_to_req.long(), meta.positions
    slots = meta.block_tables[req, pos // bs].long() * bs + pos % bs
    write_kv(kv_cache, k, v, slots)
    return reference_paged_attention(q, k, v, kv_cache, meta, spec)


class NoNullBlockBackend(CPUBackend):
    name = "broken_null_block"
    priority = -100
    attention = staticmethod(_slots_from_tables)

    def bucket_policy(self):
        return _padded_policy(self.config)


class StaleReplayExecutor(GraphExecutor):
    """Bug: 'replays' the first output computed for each padded shape."""

    def __init__(self, model):
        super().__init__(model)
        self.outputs = {}

    def run(self, inputs):
        key = tuple(inputs.input_ids.shape)
        if key not in self.outputs:
            self.outputs[key] = super().run(inputs).clone()
        return self.outputs[key]


class StaleReplayBackend(CPUBackend):
    name = "broken_stale_replay"
    priority = -100
    capabilities = Capabilities(graph_mode="cuda_graph", static_shapes=True)

    def bucket_policy(self):
        return _padded_policy(self.config)

    def make_executor(self, model):
        return StaleReplayExecutor(model)


class LazyCompileExecutor(GraphExecutor):
    """Bug: compiles on first sight of a shape instead of in prepare()."""

    def __init__(self, model):
        super().__init__(model)
        self.graphs = set()

    def run(self, inputs):
        self.graphs.add((int(inputs.input_ids.shape[0]), int(inputs.attn.num_padded_reqs)))
        return super().run(inputs)

    def num_graphs(self):
        return len(self.graphs)


class GrowingGraphsBackend(CPUBackend):
    name = "broken_graph_count"
    priority = -100
    capabilities = Capabilities(graph_mode="torch_compile", counts_graphs=True)

    def make_executor(self, model):
        return LazyCompileExecutor(model)


class RaisingProbeBackend(CPUBackend):
    name = "broken_probe"
    priority = -100

    @classmethod
    def probe(cls) -> Availability:
        import not_a_real_device_library  # noqa: F401  (bug: imports the device library unguarded)
        return Availability(True)


class LeakingExecutor(GraphExecutor):
    """Bug: keeps a tensor of `numel` float32s per step (e.g. a debugging history)."""

    numel = 1 << 20   # 4 MiB

    def __init__(self, model):
        super().__init__(model)
        self.kept = []

    def run(self, inputs):
        self.kept.append(torch.ones(self.numel))
        return super().run(inputs)


class LeakingBackend(CPUBackend):
    name = "broken_leak"
    priority = -100
    capabilities = Capabilities(graph_mode="eager")

    def make_executor(self, model):
        return LeakingExecutor(model)


class SmallLeakExecutor(LeakingExecutor):
    numel = 16        # 64 bytes a step: no byte bound sees it, the number of tensors does


class SmallLeakBackend(LeakingBackend):
    name = "broken_small_leak"

    def make_executor(self, model):
        return SmallLeakExecutor(model)


class WorkspaceExecutor(GraphExecutor):
    """Healthy: a 256 MiB start-up workspace, freed before the first step."""

    def prepare(self, run_dummy, buckets):
        workspace = [torch.ones(1 << 20) for _ in range(64)]
        del workspace
        return super().prepare(run_dummy, buckets)


class WorkspaceBackend(CPUBackend):
    name = "big_workspace"
    priority = -100
    capabilities = Capabilities(graph_mode="eager")

    def make_executor(self, model):
        return WorkspaceExecutor(model)


# ---- the suite catches each one in its group -----------------------------------------
# (backend, group run, checks that fail, checks blocked by a failed prerequisite of that group)
BROKEN = [
    (TooSmallBucketBackend, "buckets", ["pad_covers_every_legal_batch"],
     ["padding_within_bound", "pad_monotonic_and_stable"]),
    (ShortBucketsBackend, "buckets", ["end_at_configured_maximum"],
     ["pad_covers_every_legal_batch", "padding_within_bound", "pad_monotonic_and_stable"]),
    (WrongShapeKVBackend, "kv_cache", ["allocation_shape_dtype"],
     ["budget", "slot_mapping_writes", "unwritten_slots_never_leak"]),
    (NoNullBlockBackend, "kv_cache", ["slot_mapping_writes"], []),
    (StaleReplayBackend, "execution", ["prepared_equals_eager"], []),
    (GrowingGraphsBackend, "execution", ["no_new_graphs_after_warmup"], []),
    (RaisingProbeBackend, "registration", ["probe_never_raises", "available_here"], ["host_device_primitives"]),
    (LeakingBackend, "hygiene", ["no_memory_growth"], []),
    (SmallLeakBackend, "hygiene", ["no_memory_growth"], []),
]


@pytest.mark.parametrize("cls, group, failing, blocked", BROKEN, ids=[b[0].name for b in BROKEN])
def test_broken_backend_is_caught_by_its_group(registered, cls, group, failing, blocked):
    name = registered(cls)
    report = run_conformance(name, groups=[group])
    assert not report.passed
    assert report.failed_groups() == {group}
    failed = {r.name for r in report.failures()}
    assert set(failing) <= failed, report.to_dict()
    for r in report.failures():
        assert r.detail  # every failure says what broke
    assert {r.name for r in report.blocked()} == set(blocked), report.to_dict()
    for r in report.blocked():
        assert r.blocked_by and set(r.blocked_by) <= {f"{group}::{n}" for n in failing}, r
        assert r.detail == f"blocked by {', '.join(r.blocked_by)}" and r.seconds == 0.0


def test_bucket_bug_blocks_its_dependents_instead_of_erroring_them(registered, capsys):
    """The whole suite on a bucket bug: one failure, every check that needs padded
    steps 'blocked by' it (not run, not an error), the rest still run; exit code 1."""
    name = registered(ShortBucketsBackend)
    report = run_conformance(name)
    root = "buckets::end_at_configured_maximum"
    assert [r.id for r in report.failures()] == [root], [(r.id, r.detail) for r in report.failures()]
    blocked = {r.id for r in report.blocked()}
    assert {"buckets::pad_covers_every_legal_batch", "kv_cache::slot_mapping_writes",
            "execution::prepared_equals_eager", "end_to_end::greedy_matches_cpu_reference",
            "end_to_end::preemption_same_tokens", "hygiene::no_memory_growth"} <= blocked, blocked
    assert len(blocked) >= 10
    assert all(r.blocked_by == [root] for r in report.blocked())
    assert report.summary()["error"] == 0 and not report.passed
    # checks that need no padding still ran, and capability excuses still win over blocking
    assert report.get("kv_cache::allocation_shape_dtype").outcome == "passed"
    assert report.get("end_to_end::speculative_decoding_same_tokens").outcome == "skipped"
    data = report.to_dict()
    assert data["summary"]["blocked"] == len(blocked) and data["summary"]["failed"] == 1
    assert [r["blocked_by"] for r in data["results"] if r["outcome"] == "blocked"] == [[root]] * len(blocked)

    from polyrunner.tools.cli import main
    rc = main(["conformance", "--backend", name, "--group", "buckets", "--group", "kv_cache"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"blocked by {root}" in out and "BLOCKED" in out
    assert "FAILED: 1 of 10 checks failed, 5 blocked by it" in out


def test_pytest_route_reports_blocked_checks_as_skipped_and_fails(tmp_path):
    """The pytest front-end: the prerequisite fails, its dependents are skipped with
    'blocked by <check>', the session exits 1; JUnit names stay stable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                                         os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "polyrunner.tools.conformance.pytest_plugin", "--pyargs",
         "polyrunner.tools.conformance", "--backend", "broken_short_buckets",
         "--conformance-plugin", "test_conformance_broken:SHORT_BUCKETS_PLUGIN",
         "--conformance-group", "registration", "--conformance-group", "buckets",
         "--conformance-threads", "1", "-q", "-p", "no:cacheprovider", "-rs", "--junitxml", str(tmp_path / "j.xml")],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 7 passed, 3 skipped" in out, out
    assert "SKIPPED [3]" in out and "blocked by buckets::end_at_configured_maximum" in out, out
    cases = list(ET.parse(tmp_path / "j.xml").getroot().iter("testcase"))
    by_name = {c.get("name"): c for c in cases}
    assert sorted(n for n, c in by_name.items() if c.find("skipped") is not None) == \
        ["pad_covers_every_legal_batch", "pad_monotonic_and_stable", "padding_within_bound"]
    assert by_name["end_at_configured_maximum"].get("classname") == "polyrunner.conformance.buckets"
    assert by_name["end_at_configured_maximum"].find("failure") is not None
    skip = by_name["pad_covers_every_legal_batch"].find("skipped")
    assert skip is not None and "blocked by buckets::end_at_configured_maximum" in skip.get("message")


def test_null_block_failure_names_the_overwritten_block(registered):
    report = run_conformance(registered(NoNullBlockBackend), checks=["kv_cache::slot_mapping_writes"])
    detail = report.get("slot_mapping_writes").detail
    assert report.get("slot_mapping_writes").outcome == "failed"
    assert "request 0's block" in detail and "null block" in detail


def test_leak_is_caught_after_other_backends_in_the_same_process(registered):
    """The leak check measures what is held, not the process's RSS: after other
    backends freed memory in this process (the CPU backend's engine keeps freed
    memory mapped, and a backend with a 256 MiB start-up workspace freed it), a
    4 MiB-a-step leak reuses those pages and grows no RSS at all ("RSS +0.0 MiB",
    passed, with the RSS-based check), yet its live tensors grow."""
    for healthy in ("cpu", registered(WorkspaceBackend)):
        report = run_conformance(healthy, groups=["hygiene"])
        assert report.passed, [(r.id, r.detail) for r in report.failures()]
    report = run_conformance(registered(LeakingBackend), groups=["hygiene"])
    result = report.get("no_memory_growth")
    assert result.outcome == "failed", result
    assert result.detail.startswith("live tensors on cpu grew by"), result.detail
    assert "x float32 (1048576,) (4.00 MiB) on cpu" in result.detail   # it names what is kept
    assert report.get("blocks_and_states_released").outcome == "passed"


def test_small_leak_is_caught_by_the_tensor_count(registered):
    result = run_conformance(registered(SmallLeakBackend), checks=["hygiene::no_memory_growth"]).results[0]
    assert result.outcome == "failed", result
    assert "more live tensors" in result.detail and "float32 (16,)" in result.detail, result.detail


def test_healthy_variants_of_the_broken_plugins_pass(registered):
    """Control: the same plumbing with the bug fixed passes the targeted groups,
    so the failures above come from the bugs, not from the harness."""

    class FixedPadded(CPUBackend):
        name = "fixed_padded"
        priority = -100
        capabilities = Capabilities(graph_mode="eager", static_shapes=True)

        def bucket_policy(self):
            return _padded_policy(self.config)

    report = run_conformance(registered(FixedPadded), groups=["buckets", "kv_cache", "execution", "hygiene"])
    assert report.passed, [(r.id, r.detail) for r in report.failures()]


def test_unknown_backend_fails_registration_and_blocks_the_rest():
    report = run_conformance("no_such_backend", groups=["registration", "buckets"])
    assert not report.passed
    assert [r.id for r in report.failures()] == ["registration::discovered"]
    assert "no plugin contributes a backend named 'no_such_backend'" in report.get("discovered").detail
    assert all(r.outcome == "blocked" and r.blocked_by == ["registration::discovered"]
               for r in report.results[1:])


def test_unavailable_backend_without_registration_group_errors_with_the_reason():
    """Prerequisites that were not selected do not block: the first check runs into
    the unavailable backend and says why; an error blocks its dependents too."""
    report = run_conformance("no_such_backend", groups=["buckets", "kv_cache"])
    errors = report.failures()
    assert [r.id for r in errors] == ["buckets::lists_sorted_unique", "kv_cache::allocation_shape_dtype",
                                      "kv_cache::alignment"], report.to_dict()
    assert all(r.outcome == "error" and "not registered" in r.detail for r in errors)
    assert len(report.blocked()) == len(report.results) - 3


def test_cli_exit_code_reports_a_broken_backend(registered, capsys):
    from polyrunner.tools.cli import main
    rc = main(["conformance", "--backend", registered(TooSmallBucketBackend), "--group", "buckets"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "[buckets]" in out and "FAIL" in out and "FAILED:" in out
