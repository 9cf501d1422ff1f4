"""The conformance checks of soft-capped and windowed attention catch a backend that ignores
the cap (or the window), and are excused, naming the capability, where the backend declares
it does not have the feature."""

from __future__ import annotations

import dataclasses

import pytest

from polyrunner.backends.cpu.plugin import CPUBackend
from polyrunner.device.backend import Capabilities
from polyrunner.plugin_api import reference_paged_attention
from polyrunner.tools.conformance import run_conformance

CAP, WINDOW, PLAIN = ("execution::attention_soft_cap_matches_reference",
                      "execution::attention_sliding_window_matches_reference",
                      "execution::attention_matches_reference")


def _ignoring(**cleared):
    def attention(q, k, v, kv_cache, meta, spec):
        return reference_paged_attention(q, k, v, kv_cache, meta, dataclasses.replace(spec, **cleared))
    return staticmethod(attention)


class IgnoresSoftCap(CPUBackend):
    name = "broken_ignores_soft_cap"
    attention = _ignoring(logits_soft_cap=None)


class IgnoresWindow(CPUBackend):
    name = "broken_ignores_window"
    attention = _ignoring(sliding_window=None)


class WithoutEither(IgnoresSoftCap):
    name = "honest_without_soft_cap_or_window"
    capabilities = Capabilities(graph_mode="eager", attention_features=frozenset())
    attention = _ignoring(logits_soft_cap=None, sliding_window=None)


def _results(registered, cls) -> dict:
    report = run_conformance(registered(cls), checks=[PLAIN, CAP, WINDOW])
    return {f"{r.group}::{r.name}": r for r in report.results}


@pytest.mark.parametrize("cls, failing", [(IgnoresSoftCap, {CAP, WINDOW}), (IgnoresWindow, {WINDOW})])
def test_ignoring_a_feature_fails_its_check(registered, cls, failing):
    results = _results(registered, cls)
    assert {c for c, r in results.items() if r.outcome == "failed"} == failing, results
    assert all(r.outcome == "passed" for c, r in results.items() if c not in failing)
    assert all("differs from the reference" in results[c].detail for c in failing)


def test_a_declared_missing_feature_excuses_its_check(registered):
    results = _results(registered, WithoutEither)
    assert results[PLAIN].outcome == "passed"
    assert (results[CAP].outcome, results[CAP].excused_by) == (
        "skipped", "capabilities.attention_features lacks 'logits_soft_cap'")
    assert (results[WINDOW].outcome, results[WINDOW].excused_by) == (
        "skipped", "capabilities.attention_features lacks 'sliding_window'")
