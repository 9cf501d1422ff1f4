"""The conformance suite's structured-output check passes on the CPU backend and
fails on a sampler that ignores the grammar bitmask."""

from __future__ import annotations

import pytest

from polyrunner.tools.conformance import run_conformance

pytest.importorskip("xgrammar")


def test_structured_check_passes_on_cpu():
    r = run_conformance("cpu", checks=["end_to_end::structured_outputs"])
    assert r.passed and [x.outcome for x in r.results] == ["passed"], r.failures()


def test_structured_check_fails_without_the_bitmask(monkeypatch):
    import polyrunner.sample.sampler as sampler
    monkeypatch.setattr(sampler, "apply_token_bitmask", lambda logits, bitmask, rows=None: logits)
    r = run_conformance("cpu", checks=["end_to_end::structured_outputs"])
    (res,) = r.results
    assert res.outcome == "failed", res
    assert "bitmask" in res.detail or "does not match" in res.detail
