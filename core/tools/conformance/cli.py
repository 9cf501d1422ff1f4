"""`polyrunner conformance --backend NAME`: run the suite, print a table per
check group, exit 0 only when every check passed (or was excused by a
declared capability or a missing optional package). A check whose prerequisite
failed is reported "blocked by <check>" and not run. `--json FILE` writes the
report as a certificate (versions, plugin, device, CPU flags; see certificate.py)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys


def add_parser(subparsers) -> None:
    from polyrunner.tools.conformance.framework import GROUPS
    p = subparsers.add_parser("conformance", help="certify a backend against the core's contract",
                              description=__doc__)
    p.add_argument("--backend", required=True, metavar="NAME",
                   help="registered backend to certify (see `polyrunner backends`); required, no default")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE[:ATTR]",
                   help="import a plugin module (or object) and register it at run time first; repeatable "
                        "(default: none, installed entry points only)")
    p.add_argument("--group", action="append", default=[], choices=GROUPS, metavar="GROUP",
                   help=f"only this check group; repeatable; one of {', '.join(GROUPS)} (default: all groups)")
    p.add_argument("--check", action="append", default=[], metavar="PATTERN",
                   help="only checks matching this glob over 'group::name' or 'name'; repeatable "
                        "(default: all checks)")
    p.add_argument("--list", action="store_true",
                   help="list the checks with their requirements and prerequisites, and exit (default: off)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the report as a JSON certificate: versions, plugin, device, CPU flags, "
                        "command, per-check results (default: none)")
    p.add_argument("--workdir", default=None, metavar="DIR",
                   help="keep the tiny model and artefacts in DIR (default: a temporary folder, removed after)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads for the run; 1 is fastest on a busy machine (default: torch's own)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print each check as it finishes, and full details (default: off)")
    # each check starts engines: their start-up INFO lines would bury the report
    p.set_defaults(func=cmd_conformance, default_log_level="warning")


def register_plugin(spec: str) -> None:
    """Register `module` or `module:attr` with the plugin manager (a no-op when
    that object is already registered, e.g. through its installed entry point)."""
    from polyrunner.plugins import get_plugin_manager, register
    module, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module)
        if attr:
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load plugin {spec!r}: {type(exc).__name__}: {exc}") from exc
    if not get_plugin_manager().is_registered(obj):
        register(obj, name=spec)


def cmd_conformance(args: argparse.Namespace) -> int:
    from polyrunner.tools.conformance.framework import run_conformance, select_checks
    from polyrunner.tools.conformance.report import MARK, format_report
    for spec in args.plugin:
        register_plugin(spec)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if args.list:
        for c in select_checks(args.group, args.check):
            req = f"  [requires {', '.join(c.requires)}]" if c.requires else ""
            if c.depends_on:
                req += f"  [after {', '.join(c.depends_on)}]"
            if c.packages:
                req += "  [needs " + ", ".join(f"{p} (polyrunner[{e}])" if e else p for p, e in c.packages) + "]"
            print(f"{c.id}: {c.doc}{req}")
        return 0

    def progress(r) -> None:
        if args.verbose:
            print(f"  {MARK[r.outcome]:5} {r.id} ({r.seconds:.2f}s)", file=sys.stderr, flush=True)

    report = run_conformance(args.backend, groups=args.group, checks=args.check, workdir=args.workdir,
                             progress=progress)
    print(format_report(report, verbose=args.verbose))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
            f.write("\n")
    return 0 if report.passed else 1
