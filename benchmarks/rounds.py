"""Interleaved benchmark rounds: every engine runs once per round, each run a fresh worker process
(its start-up and memory measured there), and the figures are medians over the rounds.

Round 1 runs the jobs in order, round 2 in reverse order, round 3 in order again, ...: no engine is
always the one that finds the page cache holding the file its neighbour just read. A job whose run
fails is dropped from later rounds with the reason its worker gave (`Job.error`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass
class Job:
    """One engine on one model file. `cmd` prints `LOAD {json}` and `RESULT {json}` lines (one per workload)."""
    engine: str
    file: str
    cmd: list[str]
    workloads: list[str]
    env: dict[str, str] | None = None
    path: str = ""
    runs: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.engine} {self.file}"


class JobFailed(RuntimeError):
    pass


def _reason(proc: subprocess.CompletedProcess, timeout: bool = False) -> str:
    """A short reason for a failed worker: its signal and the last lines it wrote to stderr."""
    if timeout:
        head = "timed out"
    elif proc.returncode < 0:
        sig = signal.Signals(-proc.returncode)
        head = f"killed by {sig.name}" + (" (illegal instruction: the binary uses an instruction set this CPU "
                                           "lacks)" if sig == signal.SIGILL else "")
    else:
        head = f"exit status {proc.returncode}"
    text = (proc.stderr or "") + (proc.stdout or "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if any(k in ln for k in ("Error", "error:", "Illegal", "illegal", "Killed",
                                                          "not supported", "unsupported", "requires"))]
    tail = (errors[-2:] if errors else lines[-3:])
    return head + (": " + " | ".join(t[:300] for t in tail) if tail else "")


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the worker's process group (children that outlived it), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_once(job: Job, timeout_s: float | None = None, log_path: Path | None = None) -> dict[str, Any]:
    """One run of `job`: {"load": LOAD json, "results": {workload: RESULT json}, "wall_s": process seconds}.
    The worker's output goes to `log_path` (.out and .err) as it runs, where given."""
    env = dict(os.environ, **(job.env or {}))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base = log_path or Path(tmp) / "run"
        out_path, err_path = base.parent / (base.name + ".out"), base.parent / (base.name + ".err")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            # its own session: the worker's children (vLLM's engine core) go with it, on a timeout too
            proc_ = subprocess.Popen(job.cmd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
            try:
                rc, timed_out = proc_.wait(timeout=timeout_s), False
            except subprocess.TimeoutExpired:
                rc, timed_out = -1, True
            finally:
                _kill_group(proc_)
        proc = subprocess.CompletedProcess(job.cmd, rc, out_path.read_text(errors="replace"),
                                           err_path.read_text(errors="replace"))
    if timed_out:
        raise JobFailed(_reason(proc, timeout=True))
    load, results = None, {}
    for line in proc.stdout.splitlines():
        if line.startswith("LOAD "):
            load = json.loads(line[5:])
        elif line.startswith("RESULT "):
            res = json.loads(line[7:])
            results[res["workload"]] = res
    if proc.returncode != 0 or set(results) != set(job.workloads):
        raise JobFailed(_reason(proc))
    return {"load": load or {}, "results": results, "wall_s": time.perf_counter() - start}


def _print(line: str) -> None:
    print(line, flush=True)


def run_rounds(jobs: list[Job], rounds: int, timeout_s: float | None = None,
               log: Callable[[str], None] = _print, log_dir: Path | None = None) -> None:
    """`rounds` interleaved rounds over `jobs` (results accumulate in each job's `runs`); each worker's
    output is kept in `log_dir` (<engine>-<file>-r<round>.out/.err) where given."""
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    for r in range(rounds):
        order = jobs if r % 2 == 0 else jobs[::-1]
        for job in order:
            if job.error:
                continue
            log_path = None if log_dir is None else log_dir / re.sub(r"[^\w.-]+", "_", f"{job.label}-r{r + 1}")
            log(f"[compare] round {r + 1}/{rounds}: {job.label}" + (f" (log: {log_path}.err)" if log_path else ""))
            try:
                run = run_once(job, timeout_s, log_path)
            except JobFailed as exc:
                job.error = str(exc)
                log(f"[compare] {job.label} FAILED, dropped: {job.error}")
                continue
            run["round"] = r + 1
            job.runs.append(run)
            parts = []
            for w, res in run["results"].items():
                parts.append(f"{w} {res['output_tok_s']:.1f} out tok/s" +
                             (f", {res['tpot_ms']:.1f} ms/token" if "tpot_ms" in res else ""))
            log(f"[compare]   start {run['load'].get('start_s', float('nan')):.2f} s, " + "; ".join(parts))


def describe(rounds: int, max_tokens: int | None = None) -> str:
    """How the figures were made, for the lines under or above a table (`max_tokens`: a smoke run's cap)."""
    return (f"{rounds} interleaved round{'s' if rounds != 1 else ''} (every engine once per round, a fresh process "
            f"each), median per engine" + (f"; SMOKE: output capped at {max_tokens} tokens, not a measurement"
                                           if max_tokens else ""))


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary(job: Job) -> dict[str, Any]:
    """Medians over the rounds: per workload every numeric metric; start-up (first round, median of the
    later ones); resident memory after load, peak during load, at the end."""
    out: dict[str, Any] = {"engine": job.engine, "file": job.file, "rounds": len(job.runs), "error": job.error}
    if not job.runs:
        return out
    for w in job.workloads:
        rows = [run["results"][w] for run in job.runs]
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out[w] = {k: _median([row.get(k) for row in rows]) for k in keys}
    loads = [run["load"] for run in job.runs]
    out["start_first_s"] = loads[0].get("start_s")
    out["start_later_s"] = _median([ld.get("start_s") for ld in loads[1:]])
    for key in ("rss_after_load", "peak_load"):
        out[key] = _median([ld.get(key) for ld in loads])
    last = job.workloads[-1]
    out["rss_end"] = _median([run["results"][last].get("rss_end") for run in job.runs])
    out["peak_end"] = _median([run["results"][last].get("peak_end") for run in job.runs])
    return out
