"""Which bfloat16 linear kernel runs a step of M rows: chosen by timing each one on this machine.

Kernels (`LINEAR_KERNELS`): "amx" (`linear_amx.cpp`, AMX tiles), "dpbf16" (`linear_bf16.cpp`,
AVX512_BF16 dot products) and "avx512" (`linear_avx512.cpp`, bfloat16 widened to float32 FMAs on
AVX-512F alone: CPUs without AVX512_BF16), all on the work-sharing pool, and "onednn" (torch's
packed mkldnn linear, on OpenMP). `available()` lists those this process can run
(`POLYRUNNER_CPU_AMX=0` / `POLYRUNNER_CPU_DPBF16=0` / `POLYRUNNER_CPU_AVX512=0` take one away:
stand-ins for CPUs without it).

`linear_table(weights)` times every available kernel at each weight shape (N, K) of the model for the
row counts `ROWS` (the LM head's rows are requests, so up to `max_num_seqs`), on the model's own
weights: a shape's layers in turn, enough of them that the weights stream from beyond the core's
caches as they do in a step; where the ranking at a row count looks like one burst of load elsewhere
could have turned it (a winner unlike its neighbours', or a close second), the contenders are timed
again after the first pass and each keeps its faster time (noise only adds). The times
(microseconds per call) are cached in
`cache_dir()/kernel-table-<key>.json`, the key made of the CPU model and flags, the thread count,
torch's version and the kernel library's build, so a later start on the machine measures nothing
(a shape or kernel missing from the file is measured and added). `plan(times, limit)` then names,
for each M = 0..limit, the kernel whose time interpolated between the measured row counts is lowest
(above the last row count: the choice there). `POLYRUNNER_CPU_LINEAR=<kernel>` forces one kernel
for every shape and row count (an error where it cannot run).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from polyrunner.backends.cpu import envs, kernels
from polyrunner.backends.cpu import threads as threads_

logger = logging.getLogger(__name__)

VERSION = 5  # of the file format and the timing method: a change re-measures
LINEAR_KERNELS = ("amx", "dpbf16", "avx512", "onednn")
POOL_KERNELS = frozenset({"amx", "dpbf16", "avx512"})   # run on the work-sharing pool (graph-replayable)
POOL_STEP_ROWS = 64   # steps up to this many rows may run whole on the pool (executor.py)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
STREAM_BYTES = 64 << 20   # a shape's layers timed in turn up to this many weight bytes (at most every layer)
STREAM_ROWS = 64          # above: compute-bound, two layers are enough
REPEATS = 5               # timed passes per (kernel, rows); the fastest counts
GIVE_UP = 4.0             # a kernel this many times slower than the best at some rows is not timed above
RECHECK_MARGIN = 0.1      # a runner-up within 10% of the winner is timed again with it (`_recheck`)
RECHECK_REPEATS = 2       # timed passes of that second look
BUSY_LIMIT = 0.5          # cores other processes may keep busy while timing, for the times to be cached

Times = dict[str, dict[int, float | None]]   # kernel -> rows -> us per call (None: not timed, too slow)


# ---- the kernels ------------------------------------------------------------------
def available(bias: bool = False) -> list[str]:
    """The kernels this process can run for a bfloat16 linear (with a bias: oneDNN only)."""
    names = []
    if not bias and kernels.amx_available():
        names.append("amx")
    if not bias and kernels.dpbf16_available():
        names.append("dpbf16")
    if not bias and kernels.avx512_available():
        names.append("avx512")
    return names + ["onednn"]


def supports(kernel: str, shape: tuple[int, int]) -> bool:
    """Whether `kernel` takes a weight of `shape` (N, K)."""
    N, K = shape
    return {"amx": N % 16 == 0 and K % 32 == 0, "dpbf16": N % 16 == 0 and K % 2 == 0}.get(kernel, True)


def pack(kernel: str, weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`weight` [N, K] (bfloat16) in `kernel`'s layout."""
    if kernel == "amx":
        return kernels.amx_pack_bf16(weight)
    if kernel == "dpbf16":
        return kernels.dpbf16_pack_bf16(weight)
    if kernel == "avx512":
        return kernels.avx512_pack_bf16(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def runner(kernel: str) -> Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]:
    """`fn(x, packed, N, bias)` -> x @ W^T (+ bias) by `kernel`; x bfloat16 with unit stride on K."""
    if kernel == "amx":
        return lambda x, packed, N, bias: kernels.amx_linear_bf16(x, packed, N)
    if kernel == "dpbf16":
        return lambda x, packed, N, bias: kernels.dpbf16_linear_bf16(x, packed, N)
    if kernel == "avx512":
        return lambda x, packed, N, bias: kernels.avx512_linear_bf16(x, packed, N)
    return lambda x, packed, N, bias: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def forced() -> str | None:
    """`POLYRUNNER_CPU_LINEAR` when it names a kernel (ValueError when that kernel cannot run here)."""
    name = envs.LINEAR.get()
    if name in (None, "auto"):
        return None
    if name not in available():
        why = {"amx": kernels.amx_unavailable_reason, "dpbf16": kernels.dpbf16_unavailable_reason,
               "avx512": kernels.avx512_unavailable_reason}[name]()
        raise ValueError(f"POLYRUNNER_CPU_LINEAR={name}: that kernel cannot run here ({why}); "
                         f"allowed here: auto, {', '.join(available())}")
    return name


# ---- choosing -----------------------------------------------------------------------
def interpolate(points: dict[int, float | None], M: int) -> float:
    """The time at M rows, linear between the measured row counts (proportional above the last);
    inf where the kernel was not timed."""
    rows = sorted(points)
    if not rows:
        return math.inf
    lo = max([r for r in rows if r <= M], default=rows[0])
    hi = min([r for r in rows if r >= M], default=rows[-1])
    t_lo, t_hi = points[lo], points[hi]
    if t_lo is None or t_hi is None:
        return math.inf
    if M > rows[-1]:
        return t_hi * M / hi
    return t_lo if hi == lo else t_lo + (t_hi - t_lo) * (M - lo) / (hi - lo)


def plan(times: Times, limit: int, candidates: Sequence[str], align: Sequence[int] = ()) -> tuple[str, ...]:
    """The kernel for each row count M = 0..limit (index M; index 0 repeats M = 1's choice). Up to
    `POOL_STEP_ROWS` rows only pool kernels compete where one runs the shape: a step whose every
    linear runs on the pool is replayed as a CPU graph with OpenMP's team asleep (see executor.py),
    which a faster oneDNN call inside it would forfeit. `align`: the graphs' batch sizes; a step of
    M rows up to the largest takes the choice at the size it pads to, so an eager step computes
    exactly what its padded graph does (the kernels round alike only within one kernel)."""
    only = forced()
    if only is not None:
        return ((only if only in candidates else candidates[-1]),) * (limit + 1)
    names = [k for k in candidates if k in times] or list(candidates[-1:])
    pool = [k for k in names if k in POOL_KERNELS] or names
    sizes = sorted(align)

    def best(M: int) -> str:
        M = next((s for s in sizes if s >= M), M)
        return min(pool if M <= POOL_STEP_ROWS else names, key=lambda k: interpolate(times.get(k, {}), M))
    choice = [best(M) for M in range(1, limit + 1)]
    return (choice[0], *choice)


def pool_prefix(choices: Sequence[str]) -> int:
    """The largest M such that every row count 1..M runs on a pool kernel."""
    for M in range(1, len(choices)):
        if choices[M] not in POOL_KERNELS:
            return M - 1
    return len(choices) - 1


# ---- measuring ----------------------------------------------------------------------
def time_in_turns(calls: dict[str, Callable[[], object]], per_call: dict[str, int] | None = None,
                  repeats: int = REPEATS) -> dict[str, float]:
    """us per call of each of `calls` (name -> a function doing `per_call[name]` calls, default 1): the
    functions take turns within each of `repeats` repeats after one warm pass (first touch, threads
    awake), so a burst of load elsewhere on a shared host hits them alike; the fastest repeat counts."""
    best = {name: math.inf for name in calls}
    for rep in range(repeats + 1):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            if rep:
                best[name] = min(best[name], (time.perf_counter() - start) / (per_call or {}).get(name, 1) * 1e6)
    return best


def _call_each(fn: Callable, x: torch.Tensor, packed: list[torch.Tensor], N: int) -> None:
    """`fn(x, p, N, None)` for each packed layer `p` in turn (one timed pass of `measure`)."""
    for p in packed:
        fn(x, p, N, None)


def measure(weights: list[torch.Tensor], kernels_: Sequence[str], rows: Sequence[int], hint: int) -> Times:
    """us per call of each of `kernels_` at each of `rows` for one shape (`weights`: its layers,
    bfloat16 [N, K], taken in turn up to `STREAM_BYTES`), by `time_in_turns`. A kernel `GIVE_UP`
    times slower than the best at some row count is not timed above it (None)."""
    N, K = weights[0].shape
    per = weights[0].numel() * weights[0].element_size()
    layers = weights[:max(1, min(len(weights), STREAM_BYTES // max(1, per)))]
    packed = {k: [pack(k, w, hint) for w in layers] for k in kernels_}
    out: Times = {k: {} for k in kernels_}
    alive = list(kernels_)
    gen = torch.Generator().manual_seed(0)
    xs = {M: torch.randn(M, K, generator=gen).to(torch.bfloat16) for M in rows}

    def timed(M: int, names: Sequence[str], repeats: int = REPEATS) -> dict[str, float]:
        """Up to `POOL_STEP_ROWS` rows the pool kernels in turns, then oneDNN apart, each group after its
        warm pass: OpenMP's team spins for milliseconds after a oneDNN call, and the pool kernel timed
        next in the same turns ran up to 2x slower, while such steps run the pool kernels with the team
        asleep. Above, all in turns: those steps run oneDNN and the pool kernels side by side."""
        use = {k: packed[k] if M <= STREAM_ROWS else packed[k][:2] for k in names}
        out: dict[str, float] = {}
        pool = [k for k in names if k in POOL_KERNELS]
        groups = [pool, [k for k in names if k not in pool]] if M <= POOL_STEP_ROWS else [list(names)]
        for group in groups:
            if group:
                out.update(time_in_turns({k: functools.partial(_call_each, runner(k), xs[M], use[k], N) for k in group},
                                         {k: len(use[k]) for k in group}, repeats))
        return out
    for M in rows:
        best = timed(M, alive)
        fastest = min(best.values())
        for k in list(alive):
            out[k][M] = best[k]
            if best[k] > GIVE_UP * fastest:
                alive.remove(k)
        for k in kernels_:
            if k not in alive:
                out[k].setdefault(M, None)
    for M, names in _recheck(out, rows).items():   # a second look, later: a burst elsewhere only adds time
        for k, t in timed(M, names, RECHECK_REPEATS).items():
            out[k][M] = min(t, out[k][M] or math.inf)
    return out


def _recheck(times: Times, rows: Sequence[int]) -> dict[int, list[str]]:
    """Row counts whose ranking one burst of load elsewhere could have turned, with the kernels to time
    again there: where the winner differs from a neighbouring row count's (an island or a crossover:
    both winners), or a runner-up is within `RECHECK_MARGIN` of the winner (both). Rankings are among
    the kernels `plan` lets compete at that row count (pool kernels only up to `POOL_STEP_ROWS`)."""
    pool = [k for k in times if k in POOL_KERNELS]

    def ranked(M: int, names: Sequence[str]) -> list[str]:
        return sorted((k for k in names if times[k].get(M) is not None), key=lambda k: times[k][M] or math.inf)
    out: dict[int, list[str]] = {}
    for i, M in enumerate(rows):
        names = pool if pool and M <= POOL_STEP_ROWS else list(times)
        order = ranked(M, names)
        if not order:
            continue
        pick = {order[0]}
        for near in rows[max(0, i - 1):i + 2]:
            winner = ranked(near, names)[:1]
            pick.update(k for k in winner if k in order)
        best = times[order[0]][M] or math.inf
        pick.update(k for k in order[1:] if (times[k][M] or math.inf) <= (1 + RECHECK_MARGIN) * best)
        if len(pick) > 1:
            out[M] = sorted(pick)
    return out


# ---- the cached table -----------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def table_key(threads: int) -> str:
    """What the times depend on: CPU model and flags, threads, torch, the kernel library's build."""
    lib = kernels.paged_attention_kernel()
    parts = [f"v{VERSION}", _cpuinfo("model name"), _cpuinfo("flags"), str(threads), torch.__version__,
             getattr(lib, "_name", "none") or "none"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _cpuinfo(field: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return os.uname().machine


def table_path(threads: int) -> Path:
    return kernels.cache_dir() / f"kernel-table-{table_key(threads)}.json"


def shape_key(shape: tuple[int, int], hint: int) -> str:
    """A weight shape's entry in the table, timed at the pool linears' prefetch level now set
    (`linear_prefetch.py`)."""
    return f"{shape[0]}x{shape[1]}/hint{hint}/{'l2' if kernels.linear_prefetch_l2() else 'l1'}"


_parsed: dict[Path, tuple[tuple[int, int, int], dict]] = {}   # path -> (file stamp, table): one parse per change
_unsaved: dict[Path, dict] = {}   # path -> times taken under load: this process's only (see `_quiet`)


def _read(path: Path) -> dict:
    """The table in `path` (a copy: callers may add to it), {} when missing or unreadable."""
    try:
        st = path.stat()
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)   # a write replaces the file: a new inode
        if path not in _parsed or _parsed[path][0] != stamp:
            _parsed[path] = (stamp, json.loads(path.read_text()))
        return dict(_parsed[path][1])
    except (OSError, ValueError):
        return {}


def _table(path: Path) -> dict:
    """The cached table with this process's unsaved times over it: every engine in a process picks the
    same kernels."""
    return {**_read(path), **_unsaved.get(path, {})}


def _keep(path: Path, entries: dict, quiet: bool) -> None:
    """Add `entries` to the table file when they were timed `quiet`ly, else to this process's memo."""
    if quiet:
        _write(path, {**_read(path), **entries})   # with what other engines added meanwhile
    else:
        _unsaved.setdefault(path, {}).update(entries)


def cached(key: str, measure_fn: Callable[[], Times], threads: int) -> Times:
    """The times stored under `key` in the table for `threads`, else `measure_fn()`'s, stored."""
    path = table_path(threads)
    table = _table(path)
    if key in table:
        return {k: {int(M): t for M, t in v.items()} for k, v in table[key].items()}
    start, before = time.perf_counter(), threads_.cpu_sample()
    times = measure_fn()
    _keep(path, {key: times}, _quiet(before, key))
    logger.info("timed %s in %.2f s: %s", key, time.perf_counter() - start,
                ", ".join(f"{k} {sum(t for t in v.values() if t is not None):.0f} us" for k, v in times.items()))
    return times


def _quiet(before: tuple[float, float, float] | None, what: str) -> bool:
    """Whether other processes left the cores alone while `what` was timed (since `before`): at most
    `BUSY_LIMIT` cores busy elsewhere. Times taken under load rank kernels by how they suffer from it,
    so they are kept for this process only and not cached (the next start times again); said at INFO
    (a library says nothing on stderr unless the application configures logging)."""
    busy = threads_.busy_elsewhere(before, threads_.cpu_sample())
    if busy > BUSY_LIMIT:
        logger.info("timed %s while other processes kept %.1f cores busy: not cached (the next start "
                    "times it again)", what, busy)
        return False
    return True


def linear_table(weights: dict[tuple[int, int], list[torch.Tensor]], hint: int, threads: int,
                 rows_limit: dict[tuple[int, int], int] | None = None) -> dict[tuple[int, int], Times]:
    """Times for every shape of `weights` (shape -> its layers' weights), from the cache file where
    there, else measured with `threads` threads (pool and OpenMP) and added to it. `rows_limit`: the
    most rows a shape's steps have (default the last of `ROWS`)."""
    path = table_path(threads)
    cached = _table(path)
    names = available()
    out, measured, start, before = {}, [], time.perf_counter(), threads_.cpu_sample()
    saved = torch.get_num_threads()
    try:
        for shape, layers in weights.items():
            limit = (rows_limit or {}).get(shape, ROWS[-1])
            rows = [r for r in ROWS if r < limit] + [min(limit, ROWS[-1])]
            entry = {k: {int(M): t for M, t in v.items()} for k, v in cached.get(shape_key(shape, hint), {}).items()}
            todo = [k for k in names if supports(k, shape) and (k not in entry or not set(rows) <= set(entry[k]))]
            if todo:
                if not measured:
                    torch.set_num_threads(threads)
                    kernels.set_pool_threads(threads)
                entry = {**{k: v for k, v in entry.items() if k not in todo}, **measure(layers, todo, rows, hint)}
                cached[shape_key(shape, hint)] = entry
                measured.append(shape)
            out[shape] = entry
    finally:
        torch.set_num_threads(saved)
    if measured:
        _keep(path, {shape_key(shape, hint): cached[shape_key(shape, hint)] for shape in measured},
              _quiet(before, "the bfloat16 linear kernels"))
        logger.info("timed the bfloat16 linear kernels (%s) at %d weight shapes in %.1f s on %d threads; "
                    "cached in %s", ", ".join(names), len(measured), time.perf_counter() - start, threads, path)
    return out


def plans(weights: dict[tuple[int, int], list[torch.Tensor]], hint: int, threads: int,
          limit: int, align: Sequence[int] = ()) -> dict[tuple[int, int], tuple[str, ...]]:
    """The kernel for each row count 0..`limit` of each shape of `weights` (shape -> its layers'
    weights, no bias): `POLYRUNNER_CPU_LINEAR`'s where set, else the fastest in `linear_table`
    (`align`: see `plan`)."""
    if not weights:
        return {}
    only = forced()
    contested = {s: w for s, w in weights.items() if len([k for k in available() if supports(k, s)]) > 1}
    tables = {} if only is not None else linear_table(contested, hint, threads, {s: limit for s in contested})
    out = {s: plan(tables.get(s, {}), limit, [k for k in available() if supports(k, s)], align) for s in weights}
    reports.append(format_table(tables, out) if tables else
                   f"every linear of shapes {', '.join(f'{n} x {k}' for n, k in weights)}: "
                   + (f"{only} (POLYRUNNER_CPU_LINEAR)" if only else f"{available()[0]}, the only kernel here"))
    return out


reports: list[str] = []   # every `plans` table of this process, in order (`packed_linear.planned`)


def _write(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    os.replace(tmp, path)   # atomic: concurrent engines agree on the file


def format_table(tables: dict[tuple[int, int], Times], plans: dict[tuple[int, int], tuple[str, ...]]) -> str:
    """One line per (shape, row count): each kernel's time and the kernel chosen."""
    names = [k for k in LINEAR_KERNELS if any(k in t for t in tables.values())]
    lines = [f"{'shape N x K':>14} {'rows':>5} " + " ".join(f"{k + ' us':>11}" for k in names) + "  chosen"]
    for shape, times in tables.items():
        rows = sorted({M for t in times.values() for M in t})
        for M in rows:
            cells = [times.get(k, {}).get(M) for k in names]
            chosen = plans[shape][min(M, len(plans[shape]) - 1)]
            lines.append(f"{shape[0]:>7} x {shape[1]:<4} {M:>5} "
                         + " ".join(f"{'-' if c is None else f'{c:.1f}':>11}" for c in cells) + f"  {chosen}")
    return "\n".join(lines)
