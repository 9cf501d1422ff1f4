"""The check registry, outcomes and the runner shared by both front-ends.

A check is a plain function `fn(ctx) -> str | None` registered with
`@check(group, requires=...)`. It passes by returning (optionally a short
note), fails by raising `CheckFailure` (or any AssertionError), and errors
on any other exception. A check may be skipped ONLY through `requires`
(capability requirements read from the backend's declared `Capabilities`, so
the report can say which capability excused it) or through `packages`
(optional packages its feature needs, see below). Requirements:

    "counts_graphs", "static_shapes"                   a truthy capability flag
    "sampling:<feature>"                               feature in capabilities.sampling
    "attention:<feature>"                              feature in capabilities.attention_features
    "dtype:<name>"                                     torch.<name> in capabilities.dtypes
    "devices:<n>"                                      Backend.device_count() >= n on this host
    "!static_shapes"                                   a falsy capability flag (the feature is refused there)

`packages={"xgrammar": "structured"}`: the feature the check covers needs the
optional package `xgrammar` (an import name), installed by the extra
`polyrunner[structured]`. Where it is not installed the check is skipped, the
reason naming the package and the extra; an installed package that fails to
import is no excuse (the check runs and reports the error).

`depends_on=("buckets::pad_covers_every_legal_batch", ...)`: prerequisites, by
check id (`group::name`) or by group name (every check of that group). When a
prerequisite that ran in this run failed, errored or was itself blocked, the
check is not run and is reported `blocked` by the failed check (the root of the
chain), which is not a failure of its own: the run fails through the
prerequisite. A prerequisite that was not selected does not block. Every check
outside `registration` depends on `registration::available_here`.
Prerequisites must come earlier in the run order (group order, then definition
order); `all_checks()` refuses a declaration that breaks this.
"""

from __future__ import annotations

import fnmatch
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

if TYPE_CHECKING:
    from polyrunner.device.backend import Capabilities
    from polyrunner.tools.conformance.certificate import Environment
    from polyrunner.tools.conformance.context import ConformanceContext

GROUPS = ("registration", "buckets", "kv_cache", "ops", "execution", "end_to_end", "distributed", "hygiene")
GROUP_MODULES = {g: f"polyrunner.tools.conformance.{g}" for g in GROUPS}

PASSED, FAILED, ERROR, SKIPPED, BLOCKED = "passed", "failed", "error", "skipped", "blocked"
OUTCOMES = (PASSED, FAILED, ERROR, SKIPPED, BLOCKED)

# Prerequisites shared by the groups (check ids).
AVAILABLE = "registration::available_here"              # implicit for every check outside registration
PADS = "buckets::pad_covers_every_legal_batch"           # steps can be padded
ALLOCATES = "kv_cache::allocation_shape_dtype"           # KV caches have the promised layout
ENGINE_RUNS = (PADS, ALLOCATES)                         # an engine can be built and stepped
MODEL_RUNS = ("ops::overrides_match_reference", "execution::prepared_equals_eager",   # its numbers hold
              "execution::attention_matches_reference")


class CheckFailure(AssertionError):
    """The backend broke the contract this check verifies."""


def fail(message: str) -> None:
    raise CheckFailure(message)


def expect(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailure(message)


@dataclass(frozen=True)
class Check:
    group: str
    name: str
    func: Callable[["ConformanceContext"], str | None]
    requires: tuple[str, ...] = ()
    doc: str = ""
    packages: tuple[tuple[str, str], ...] = ()   # (import name, polyrunner extra that installs it)
    depends_on: tuple[str, ...] = ()             # prerequisites: check ids or group names

    @property
    def id(self) -> str:
        return f"{self.group}::{self.name}"

    @property
    def prerequisites(self) -> tuple[str, ...]:
        """Declared prerequisites, plus `registration::available_here` outside registration."""
        implicit = (AVAILABLE,) if self.group != "registration" and AVAILABLE not in self.depends_on else ()
        return implicit + self.depends_on


_CHECKS: dict[str, Check] = {}


def check(group: str, *, requires: Iterable[str] = (), packages: Mapping[str, str] | None = None,
          depends_on: Iterable[str] = ()) -> Callable:
    """Register `fn` as check `<group>::<fn name without a leading check_>`.
    `requires`: capability requirements; `packages`: optional packages the checked
    feature needs, import name -> the polyrunner extra that installs it (skipped
    where one is not installed); `depends_on`: prerequisite check ids or group
    names (blocked when one fails). See the module docstring."""
    if group not in GROUPS:
        raise ValueError(f"unknown check group {group!r}; groups: {GROUPS}")
    pkgs = tuple((str(k), str(v)) for k, v in (packages or {}).items())
    bad = [k for k, _ in pkgs if not k.isidentifier()]
    if bad:
        raise ValueError(f"packages are named by their top-level import name; not {bad}")

    def deco(fn: Callable) -> Callable:
        name = fn.__name__.removeprefix("check_")
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""
        c = Check(group, name, fn, tuple(requires), doc, pkgs, tuple(depends_on))
        _CHECKS[c.id] = c
        return fn

    return deco


def all_checks() -> list[Check]:
    """Every check, in group order, then definition order."""
    import importlib
    for module in GROUP_MODULES.values():
        importlib.import_module(module)
    order = {g: i for i, g in enumerate(GROUPS)}
    checks = sorted(_CHECKS.values(), key=lambda c: order[c.group])  # stable: definition order kept
    _validate_prerequisites(checks)
    return checks


def _validate_prerequisites(checks: list[Check]) -> None:
    """Every prerequisite names a known check or group that runs earlier."""
    position = {c.id: i for i, c in enumerate(checks)}
    for i, c in enumerate(checks):
        for p in c.depends_on:
            if p in GROUPS:
                if GROUPS.index(p) >= GROUPS.index(c.group):
                    raise ValueError(f"check {c.id} depends on group {p!r}, which does not run before it")
            elif p not in position:
                raise ValueError(f"check {c.id} depends on {p!r}, which is neither a check id nor a group; "
                                 f"groups: {', '.join(GROUPS)}")
            elif position[p] >= i:
                raise ValueError(f"check {c.id} depends on {p}, which runs after it")


def blocked_by(c: Check, results: Mapping[str, "CheckResult"]) -> list[str]:
    """The failed checks (roots of the chain) that block `c`, given the results of
    this run so far (by check id); [] when `c` may run."""
    roots: list[str] = []
    for p in c.prerequisites:
        found = [r for r in results.values() if r.group == p] if p in GROUPS else \
            [results[p]] if p in results else []
        for r in found:
            new = r.blocked_by if r.outcome == BLOCKED else [r.id] if r.outcome in (FAILED, ERROR) else []
            roots += [x for x in new if x not in roots]
    return roots


def select_checks(groups: Iterable[str] | None = None, patterns: Iterable[str] | None = None) -> list[Check]:
    groups = list(groups or [])
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise ValueError(f"unknown check group(s) {bad}; groups: {', '.join(GROUPS)}")
    patterns = list(patterns or [])
    out = []
    for c in all_checks():
        if groups and c.group not in groups:
            continue
        if patterns and not any(fnmatch.fnmatch(c.id, p) or fnmatch.fnmatch(c.name, p) for p in patterns):
            continue
        out.append(c)
    return out


def unmet_requirements(caps: "Capabilities", requires: Iterable[str],
                       device_count: Callable[[], int] | None = None) -> list[str]:
    """Human-readable reasons, one per requirement the declared capabilities (and
    the host's device count) do not meet."""
    import torch
    unmet = []
    for req in requires:
        if req.startswith("devices:"):
            need, have = int(req.split(":", 1)[1]), device_count() if device_count is not None else 1
            if have < need:
                unmet.append(f"{have} device(s) here, {need} needed")
        elif req.startswith("sampling:"):
            feature = req.split(":", 1)[1]
            if feature not in caps.sampling:
                unmet.append(f"capabilities.sampling lacks {feature!r}")
        elif req.startswith("attention:"):
            feature = req.split(":", 1)[1]
            if feature not in caps.attention_features:
                unmet.append(f"capabilities.attention_features lacks {feature!r}")
        elif req.startswith("dtype:"):
            name = req.split(":", 1)[1]
            if getattr(torch, name) not in caps.dtypes:
                unmet.append(f"capabilities.dtypes lacks {name}")
        else:
            name, want = (req[1:], False) if req.startswith("!") else (req, True)
            if not hasattr(caps, name):
                raise ValueError(f"unknown capability requirement {req!r}")
            if bool(getattr(caps, name)) != want:
                unmet.append(f"capabilities.{name}={getattr(caps, name)!r}")
    return unmet


def install_hint(package: str, extra: str) -> str:
    return f"pip install 'polyrunner[{extra}]'" if extra else f"pip install {package}"


def missing_packages(packages: Iterable[tuple[str, str]]) -> list[str]:
    """Reasons, one per optional package (import name, extra) that is not
    installed here: "<package> is not installed: pip install 'polyrunner[<extra>]'".
    A package that is installed but fails to import is not missing: the check
    then runs into the import error and reports it."""
    import importlib
    missing = []
    for package, extra in packages:
        try:
            importlib.import_module(package)
        except ModuleNotFoundError as exc:
            if exc.name != package:
                continue   # installed, but one of ITS imports is missing: a broken install, not an excuse
            missing.append(f"{package} is not installed: {install_hint(package, extra)}")
        except Exception:  # noqa: BLE001 - broken install: the check reports it
            continue
    return missing


@dataclass
class CheckResult:
    group: str
    name: str
    outcome: str            # passed | failed | error | skipped | blocked
    detail: str = ""
    seconds: float = 0.0
    excused_by: str = ""    # for skipped checks: the capability (or missing package) that excused it
    package_missing: bool = False   # skipped because an optional package is not installed
    blocked_by: list[str] = field(default_factory=list)   # for blocked checks: the failed prerequisites

    @property
    def id(self) -> str:
        return f"{self.group}::{self.name}"

    @property
    def ok(self) -> bool:
        """Not a failure of its own: passed, skipped, or blocked by a failed prerequisite."""
        return self.outcome in (PASSED, SKIPPED, BLOCKED)


@dataclass
class Report:
    backend: str
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    environment: "Environment | None" = None   # what the report certifies (certificate.py)

    @property
    def passed(self) -> bool:
        """True when every check passed or was skipped (skips are excused by capabilities
        or by optional packages that are not installed); a blocked check means a
        prerequisite failed."""
        return bool(self.results) and all(r.outcome in (PASSED, SKIPPED) for r in self.results)

    def group(self, name: str) -> list[CheckResult]:
        return [r for r in self.results if r.group == name]

    def get(self, check_id: str) -> CheckResult:
        for r in self.results:
            if r.id == check_id or r.name == check_id:
                return r
        raise KeyError(check_id)

    def failures(self) -> list[CheckResult]:
        """Checks that failed or errored (blocked ones are not failures of their own)."""
        return [r for r in self.results if not r.ok]

    def blocked(self) -> list[CheckResult]:
        return [r for r in self.results if r.outcome == BLOCKED]

    def failed_groups(self) -> set[str]:
        return {r.group for r in self.failures()}

    def summary(self) -> dict[str, int]:
        return {k: sum(r.outcome == k for r in self.results) for k in OUTCOMES}

    def to_dict(self) -> dict:
        """The JSON certificate: schema version, verdict, environment (certificate.py), results."""
        from polyrunner.tools.conformance.certificate import SCHEMA_VERSION
        env = asdict(self.environment) if self.environment is not None else {}
        return {"schema_version": SCHEMA_VERSION, "backend": self.backend, "passed": self.passed, **env,
                "seconds": round(self.seconds, 3), "summary": self.summary(),
                "results": [{**asdict(r), "seconds": round(r.seconds, 3)} for r in self.results]}


def run_check(c: Check, ctx: "ConformanceContext") -> CheckResult:
    """Run one check against a context and record its result in `ctx.results`."""
    result = _run_check(c, ctx)
    ctx.results[c.id] = result
    return result


def _run_check(c: Check, ctx: "ConformanceContext") -> CheckResult:
    """Skip by capability, else blocked by a failed prerequisite, else skip by
    missing package, else pass/fail/error."""
    t0 = time.perf_counter()
    caps = ctx.capabilities
    if c.requires and caps is not None:
        unmet = unmet_requirements(caps, c.requires, ctx.device_count)
        if unmet:
            return CheckResult(c.group, c.name, SKIPPED, "not applicable", 0.0, "; ".join(unmet))
    roots = blocked_by(c, ctx.results)
    if roots:
        return CheckResult(c.group, c.name, BLOCKED, f"blocked by {', '.join(roots)}", 0.0, blocked_by=roots)
    if c.group != "registration":
        blocker = ctx.blocker()   # registration was not selected: say why nothing can run
        if blocker:
            return CheckResult(c.group, c.name, ERROR, blocker, 0.0)
    if c.requires and caps is None:
        return CheckResult(c.group, c.name, SKIPPED, "not applicable", 0.0, "no capabilities")
    if c.packages:
        missing = missing_packages(c.packages)
        if missing:
            return CheckResult(c.group, c.name, SKIPPED, "optional package not installed",
                               time.perf_counter() - t0, "; ".join(missing), package_missing=True)
    try:
        note = c.func(ctx)
        outcome, detail = PASSED, note or ""
    except AssertionError as exc:
        outcome, detail = FAILED, str(exc) or type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - any crash is a conformance error, reported, not raised
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
        outcome, detail = ERROR, f"{type(exc).__name__}: {exc}{where}"
    return CheckResult(c.group, c.name, outcome, detail, time.perf_counter() - t0)


def run_conformance(backend: str, *, groups: Iterable[str] | None = None,
                    checks: Iterable[str] | None = None, settings=None, workdir: str | None = None,
                    progress: Callable[[CheckResult], None] | None = None,
                    command: list[str] | str | None = None) -> Report:
    """Run the conformance suite against the registered backend `backend`.

    `groups` / `checks` (glob patterns over `group::name` or `name`) select a
    subset; `settings` is a `ConformanceSettings`; `workdir` keeps the tiny
    model and artefacts there (default: a temporary folder, removed after);
    `command` is recorded in the report's environment (default: this process's
    command line).
    """
    from polyrunner.tools.conformance.certificate import collect_environment
    from polyrunner.tools.conformance.context import ConformanceContext
    selected = select_checks(groups, checks)
    report = Report(backend, environment=collect_environment(backend, command))
    t0 = time.perf_counter()
    with ConformanceContext(backend, settings=settings, workdir=workdir) as ctx:
        for c in selected:
            result = run_check(c, ctx)
            report.results.append(result)
            if progress is not None:
                progress(result)
    report.seconds = time.perf_counter() - t0
    return report
