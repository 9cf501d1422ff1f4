"""Check a `pip install --dry-run --report` resolution of one extra against the table of
supported pairs (backends/supported_versions.py, loaded by path: this runs with any
Python 3.10+, polyrunner need not be installed).

    python .ci/check_resolution.py EXTRA REPORT.json     # EXTRA "" = no extra

Prints one summary line; exit 1 with the problems when the resolution disagrees.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("supported_versions", ROOT / "backends" / "supported_versions.py")
sv = importlib.util.module_from_spec(_spec)
sys.modules["supported_versions"] = sv   # dataclasses look the module up by name
_spec.loader.exec_module(sv)

try:
    from packaging.markers import Marker
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.markers import Marker


def resolved(report: dict) -> dict[str, str]:
    """Normalized distribution name -> version, for everything the report would install."""
    return {sv.normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in report.get("install", [])}


def cuda_libraries(installed: dict[str, str]) -> list[str]:
    return sorted(n for n in installed if n.startswith(("nvidia-", "cuda-")))


def _in_range(version: str, requirement: str) -> bool:
    """version against 'torch>=A,<B' (only >=, <, == clauses, on release numbers)."""
    found = sv.release(version)
    for op, bound in re.findall(r"(>=|<|==)\s*([0-9][0-9.]*)", requirement):
        want = sv.release(bound)
        if (op == ">=" and found < want) or (op == "<" and found >= want) \
                or (op == "==" and found[:len(want)] != want):
            return False
    return True


def check(extra: str, report: dict) -> tuple[str, list[str]]:
    """(summary line, problems) for the resolution of `polyrunner[extra]` in `report`."""
    installed = resolved(report)
    problems: list[str] = []
    torch = installed.get("torch")
    cuda = cuda_libraries(installed)
    if torch is None:
        problems.append("torch is not in the resolution (run the dry run in a fresh venv)")
    elif not _in_range(torch, sv.TORCH_REQUIREMENT):
        problems.append(f"torch {torch} is outside {sv.TORCH_REQUIREMENT}")
    stack = sv.STACKS.get(extra)
    if extra and stack is None:
        problems.append(f"{extra!r} is not in supported_versions.STACKS ({', '.join(sv.STACKS)})")
    if stack is not None:
        applies = not stack.marker or Marker(stack.marker).evaluate(report.get("environment") or None)
        for dist, version in stack.expected().items():
            got = installed.get(dist)
            if not applies:
                if dist != "torch" and got is not None:
                    problems.append(f"{dist} {got} is installed where the extra does not apply ({stack.marker})")
            elif got is None:
                problems.append(f"{dist} is missing (expected {version})")
            elif sv.release(got) != sv.release(version):
                problems.append(f"{dist} resolved to {got}, the table says {version}")
        if stack.cpu_only and cuda:
            problems.append(f"a CUDA build of torch: {len(cuda)} CUDA libraries ({', '.join(cuda[:3])}, ...)")
    build = "cpu" if torch and not cuda else "cuda" if torch else "-"
    devices = ", ".join(f"{d} {installed[d]}" for d in (stack.expected() if stack else {}) if d != "torch"
                        and d in installed)
    summary = (f"[{extra or 'no extra'}] torch {torch or '-'} ({build} build, {len(cuda)} CUDA libraries)"
               + (f", {devices}" if devices else "") + f", {len(installed)} packages")
    return summary, problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    extra, path = argv
    summary, problems = check(extra, json.loads(Path(path).read_text()))
    print(summary)
    for p in problems:
        print(f"  ERROR: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
