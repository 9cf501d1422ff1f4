"""Plain-text rendering of a conformance `Report`: one table per check group."""

from __future__ import annotations

from polyrunner.tools.conformance.framework import GROUPS, SKIPPED, Report

MARK = {"passed": "PASS", "failed": "FAIL", "error": "ERROR", "skipped": "SKIP", "blocked": "BLOCKED"}
DETAIL_WIDTH = 110


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_WIDTH else text[: DETAIL_WIDTH - 3] + "..."


def _header(report: Report) -> list[str]:
    env = report.environment
    if env is None:
        return []
    libs = ", ".join(f"{lib.distribution} {lib.version or '(not installed)'}" for lib in env.device_libraries)
    plugin = env.plugin
    source = f"{plugin.distribution} {plugin.version}" if plugin.distribution else "no installed distribution"
    return [f"  polyrunner {env.versions.get('polyrunner')}, torch {env.versions.get('torch')}, "
            f"python {env.versions.get('python')}" + (f", {libs}" if libs else ""),
            f"  plugin {plugin.backend_class or '?'} ({source}); device {env.device or '?'}"]


def format_report(report: Report, verbose: bool = False) -> str:
    lines = [f"polyrunner conformance: backend {report.backend!r}", *_header(report)]
    for group in GROUPS:
        results = report.group(group)
        if not results:
            continue
        counts = {k: sum(r.outcome == k for r in results) for k in MARK}
        summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        lines.append("")
        lines.append(f"[{group}] {summary}")
        rows = [("check", "result", "time", "detail")]
        for r in results:
            detail = r.detail
            if r.outcome == SKIPPED:   # "excused: <capability>" or "<package> is not installed: <how>"
                detail = r.excused_by if r.package_missing else f"excused: {r.excused_by}"
            rows.append((r.name, MARK[r.outcome], f"{r.seconds:.2f}s", detail if verbose else _short(detail)))
        lines += _table(rows)
    skipped = [r for r in report.results if r.outcome == SKIPPED]
    by_capability = [r for r in skipped if not r.package_missing]
    by_package = [r for r in skipped if r.package_missing]
    lines.append("")
    if by_capability:
        lines.append("skipped (excused by declared capabilities):")
        lines += [f"  {r.id}: {r.excused_by}" for r in by_capability]
    if by_package:
        lines.append("skipped (optional packages not installed):")
        lines += [f"  {r.id}: {r.excused_by}" for r in by_package]
    blocked = report.blocked()
    if blocked:
        lines.append("blocked (not run: a prerequisite failed):")
        lines += [f"  {r.id}: {r.detail}" for r in blocked]
    failed = report.failures()
    n = len(report.results)
    if failed or blocked:
        lines.append(f"FAILED: {len(failed)} of {n} checks failed"
                     + (f", {len(blocked)} blocked by {'it' if len(failed) == 1 else 'them'}" if blocked else "")
                     + f", in {report.seconds:.1f}s "
                     f"(groups: {', '.join(g for g in GROUPS if g in report.failed_groups())})")
        lines += [f"  {r.id}: {r.outcome}: {r.detail}" for r in failed]
    else:
        lines.append(f"PASSED: {n - len(skipped)} passed, {len(skipped)} skipped, in {report.seconds:.1f}s")
    return "\n".join(lines)
