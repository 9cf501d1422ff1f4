"""How many threads the CPU backend runs, and where.

- Count: `POLYRUNNER_CPU_THREADS` (default "auto": one thread per physical core
  this process may use -- SMT siblings share a core's load/store and vector units,
  and a decode step is bound by memory bandwidth, so a second thread per core
  only adds synchronisation).
- Affinity: the decode kernels' helper threads (`thread_pool.cpp`) may run on one
  CPU of each physical core (the lowest-numbered sibling), not pinned to a single
  one: on a shared host a thread pinned to a busy core could not move.
- A slow thread does not stall a step: the pool lets the caller and whichever
  helpers are running share a call's chunks, and returns once every chunk is
  done; a helper that wakes late finds nothing left. `POLYRUNNER_CPU_SPIN_US`
  (default 200) is how long an idle helper spins before sleeping.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from polyrunner.backends.cpu import envs, kernels

SYS_CPU = Path("/sys/devices/system/cpu")


def usable_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cores_of(cpus: list[int], sys_cpu: Path = SYS_CPU) -> dict[int, int]:
    """Each CPU's physical core, named by its lowest-numbered SMT sibling among
    `cpus` (`topology/thread_siblings_list`); a CPU whose topology cannot be read
    counts as its own core."""
    first: dict[str, int] = {}
    core: dict[int, int] = {}
    for cpu in sorted(cpus):
        try:
            key = (sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            key = f"cpu{cpu}"
        core[cpu] = first.setdefault(key, cpu)
    return core


def physical_cpus(cpus: list[int] | None = None, sys_cpu: Path = SYS_CPU) -> list[int]:
    """One CPU per physical core among `cpus` (default: the usable ones): the
    lowest-numbered of each core's SMT siblings."""
    return sorted(set(cores_of(usable_cpus() if cpus is None else cpus, sys_cpu).values()))


def rank_cpus(local_rank: int, local_size: int) -> list[int]:
    """The CPUs of tensor-parallel rank `local_rank` of `local_size` on this host: a
    contiguous share of the physical cores with their SMT siblings ([] when there
    are fewer cores than ranks: the ranks then share every CPU)."""
    core = cores_of(usable_cpus())
    cores = sorted(set(core.values()))
    if len(cores) < local_size or local_size < 2:
        return []
    per = len(cores) // local_size
    mine = set(cores[local_rank * per:(local_rank + 1) * per])
    return sorted(cpu for cpu, c in core.items() if c in mine)


def threads_auto() -> bool:
    """Whether `POLYRUNNER_CPU_THREADS` is "auto" (the default): the count follows the load."""
    return envs.THREADS.get() == "auto"


def default_threads() -> int:
    """`POLYRUNNER_CPU_THREADS`, or the number of physical cores ("auto", the default). An
    explicit count is capped at the CPUs this process may use: a tensor-parallel rank or a
    data-parallel replica pinned to its share of the cores (`rank_cpus`) inherits the setting,
    and more threads than CPUs only take turns at every barrier of the spinning pool."""
    setting = envs.THREADS.get()
    return max(1, len(physical_cpus())) if setting == "auto" else min(setting, len(usable_cpus()))


def spin_us() -> int:
    """`POLYRUNNER_CPU_SPIN_US` (default 200): how long an idle pool helper spins before sleeping."""
    return envs.SPIN_US.get()


def start_pool() -> int:
    """(Re)start the decode kernels' pool (`thread_pool.cpp`) for an engine: `default_threads()`
    threads, helpers on one CPU per physical core under "auto", idle helpers spinning `spin_us()`;
    returns the thread count. The executor does; so does the "linear" op override before it times
    the kernels (`kernel_table`), which must run as they will in the engine."""
    count = default_threads()
    kernels.start_pool(count, physical_cpus() if threads_auto() else None, spin_us())
    return count


def cpu_sample() -> tuple[float, float, float] | None:
    """(monotonic time, seconds every CPU was busy, seconds this process ran), from Linux's
    /proc/stat; None elsewhere. Two samples give how many cores other processes kept busy."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    values = [int(x) for x in fields]
    busy = (sum(values[:8]) - values[3] - values[4]) / ticks  # all but idle and iowait
    t = os.times()
    return time.monotonic(), busy, t.user + t.system


def busy_elsewhere(start: tuple[float, float, float] | None, end: tuple[float, float, float] | None) -> float:
    """Cores other processes kept busy on average between two `cpu_sample`s (0.0 when unknown):
    a lower bound, as both counters tick in 1/CLK_TCK s (two ticks of their difference may be
    rounding; over a 30 ms window that alone would read as 0.7 cores)."""
    if start is None or end is None or end[0] <= start[0]:
        return 0.0
    rounding = 2 / os.sysconf("SC_CLK_TCK")
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2]) - rounding) / (end[0] - start[0])
