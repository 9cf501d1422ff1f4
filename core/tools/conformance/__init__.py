"""The conformance suite: certify a backend against the core's contract.

Run it against any registered backend:

    polyrunner conformance --backend NAME             # exit 0 only when all passed
    pytest -p polyrunner.tools.conformance.pytest_plugin --pyargs polyrunner.tools.conformance --backend NAME

or from Python:

    from polyrunner.tools.conformance import run_conformance
    report = run_conformance("cpu")
    assert report.passed, report.failures()

Checks are plain functions grouped by module, both front-ends run them:

    registration  discovered via entry point or run-time registration; probe() never raises
    buckets       every legal (tokens, requests) pair pads to a covering bucket; lists sorted,
                  unique, ending at the configured maximum; padding within `max_padding`
    kv_cache      logical shape, dtype, alignment, byte budget; slot_mapping writes land in
                  the right block/offset; padded tokens write only the null block
    ops           every op override (`Backend.op_overrides`) matches its role's reference on
                  random shapes, per declared dtype (attention: see execution)
    execution     prepared (captured/compiled/warmed-up) == eager for every bucket (sampled);
                  no new graph after warm-up (when `capabilities.counts_graphs`)
    end_to_end    greedy == CPU reference token for token; seeded sampling reproducible;
                  preemption and chunked prefill change no token; structured outputs (JSON
                  schema, regex, choice) hold on every output
    hygiene       all KV blocks free and no request state after a run; no memory growth

A check is skipped only when the backend's declared `Capabilities` excuse it
(the report names the capability) or when its feature needs an optional
package that is not installed (the report names the package and the extra:
"xgrammar is not installed: pip install 'polyrunner[structured]'"). A check
whose prerequisite failed (`@check(..., depends_on=...)`) is not run and is
reported "blocked by <group>::<check>". `Report.to_dict()` (the CLI's `--json`)
is a certificate: schema version, polyrunner/torch/python versions, the
plugin's distribution, device libraries, device, CPU flags, date, command,
per-check results (certificate.py). Under pytest with `--junitxml`, testcases are
named `polyrunner.conformance.<group>` / `<check>`. The suite writes its own
tiny random Llama (plain torch + safetensors; transformers is not needed).
"""

from __future__ import annotations

__all__ = ["run_conformance", "Report", "CheckResult", "Check", "ConformanceSettings", "GROUPS",
           "all_checks", "select_checks", "check", "CheckFailure", "format_report", "write_tiny_llama"]


def __getattr__(name: str):
    # Lazy: importing the package (the CLI does, to add its sub-command) must stay light.
    if name in ("run_conformance", "Report", "CheckResult", "Check", "GROUPS", "all_checks",
                "select_checks", "check", "CheckFailure"):
        from polyrunner.tools.conformance import framework
        return getattr(framework, name)
    if name == "ConformanceSettings":
        from polyrunner.tools.conformance.context import ConformanceSettings
        return ConformanceSettings
    if name == "format_report":
        from polyrunner.tools.conformance.report import format_report
        return format_report
    if name == "write_tiny_llama":
        from polyrunner.tools.conformance.tiny_llama import write_tiny_llama
        return write_tiny_llama
    raise AttributeError(f"module 'polyrunner.tools.conformance' has no attribute {name!r}")
