"""Keeping page faults out of the CPU backend's steps.

A step that touches memory the process has never touched, or has handed back to
the kernel, pays a page fault per 4 KiB page: cheap on bare metal, tens of times
dearer on a VM whose memory the host backs lazily (figures: benchmarks/results/design-measurements.md).
Three concerns, one remedy each:

- The KV cache. It is allocated untouched (zeroing 4 GiB up front would cost
  seconds of start-up), and with prefix caching the block pool hands out every block
  once before it reuses any. A server therefore faults in a new 1 GiB of cache
  pages per 256 requests until the whole cache has been used, and served throughput
  drops while it does.
  With `CacheConfig.prefault_kv_cache` (what `polyrunner serve` sets; an offline
  `LLM` faults in only the blocks it uses and holds no more memory than that),
  `prefault_in_background` has a daemon thread at the lowest CPU priority ask
  the kernel to map the pages (`madvise(MADV_POPULATE_WRITE)`, Linux 5.14+),
  about 4 MiB a round, every layer's K and V halves side by side so that the
  lowest block ids (the ones the pool hands out first) are mapped first. It maps
  the pages without writing their contents, so the engine may use the cache
  meanwhile. The thread only runs on CPU time nothing else wants (SCHED_IDLE).
  The pool also reuses freed blocks before it touches new ones (`block_pool.py`).
- TLB misses in the KV cache. A decode step reads every request's blocks, which a long-running
  server's pool scatters over a cache of gigabytes: on 4 KiB pages most blocks cost a TLB miss
  and a page walk (figures: design-measurements.md, `benchmarks/kv_huge_pages.py`).
  `advise_huge_pages` asks for transparent huge pages (`madvise(MADV_HUGEPAGE)`) before the
  cache is touched; where THP is "never" it changes nothing, where "always" nothing needed it.
- Freed activations. glibc hands freed blocks above its trim threshold back to
  the kernel, and serves large blocks from fresh mappings, so a 12 MiB
  temporary (the float32 logits of 64 rows) faults in every step. `keep_freed_memory`
  sets the limits so that freed memory stays in the process, as the tcmalloc
  preload vLLM's CPU images use would. glibc only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterator

import torch

from polyrunner.plugin_api import round_up

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14                # linux/mman.h (2.6.38+)
MADV_POPULATE_WRITE = 23          # linux/mman.h (5.14+)
HUGE_PAGE = 2 << 20               # x86-64 and arm64 transparent huge pages
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3   # malloc.h
MMAP_THRESHOLD_MAX = 32 << 20     # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 1 << 30
CHUNK_BYTES = 4 << 20   # per madvise call, which holds the address space's lock (read) while it faults


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory (up to 1 GiB above the heap's top) and serve
    blocks up to 32 MiB from its heap, so temporaries reuse mapped pages. Process-wide;
    True when set (glibc), False elsewhere."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"), None without THP."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for transparent huge pages on the 2 MiB-aligned interior of `tensor`'s memory
    (host memory not yet touched: pages faulted in before stay small). True when the
    kernel took the advice, False where it cannot (not Linux, THP not built, too small)."""
    libc = _libc()
    start = tensor.data_ptr()
    begin, end = round_up(start, HUGE_PAGE), (start + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if libc is None or end <= begin:
        return False
    return libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), MADV_HUGEPAGE) == 0


def prefault_in_background(tensors: list[torch.Tensor], parts: int = 1) -> threading.Thread | None:
    """Start a lowest-priority daemon thread that maps every page of `tensors`
    (host memory) without changing their contents; returns it, or None where the
    kernel cannot (not Linux). Each tensor is `parts` equal contiguous parts (a KV
    cache layer: its K and V halves), and the thread walks all parts side by side,
    low offsets first, so pages are mapped in the order the block pool hands blocks
    out (lowest id first). It holds weak references only: a tensor freed meanwhile is
    skipped. It stops at the first refusal (a kernel before 5.14 says EINVAL)."""
    libc = _libc()
    if libc is None or not tensors:
        return None
    refs = [weakref.ref(t) for t in tensors]
    thread = threading.Thread(target=_populate, args=(libc, refs, parts), name="polyrunner-kv-prefault", daemon=True)
    thread.start()
    return thread


def _lowest_priority() -> None:
    """This thread only runs on CPU time nothing else wants: SCHED_IDLE, else nice 19 (Linux)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # 0: the calling thread
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


def populate_order(extents: list[tuple[int, int]], parts: int, page: int,
                   chunk: int = CHUNK_BYTES) -> Iterator[tuple[int, int, int]]:
    """`(tensor index, address, bytes)` of the page-aligned calls that map `extents`
    (each tensor's (address, bytes), split into `parts` equal parts): one call per part
    per round, every part advancing by the same offset, a round mapping about `chunk`."""
    spans = []
    for i, (start, size) in enumerate(extents):
        size //= parts
        spans += [(i, round_up(start + p * size, page), (start + (p + 1) * size) // page * page) for p in range(parts)]
    step = max(page, chunk // max(len(spans), 1) // page * page)
    offset = 0
    while spans:
        spans = [(i, begin, end) for i, begin, end in spans if begin + offset < end]
        for i, begin, end in spans:
            yield i, begin + offset, min(step, end - begin - offset)
        offset += step


def _populate(libc: ctypes.CDLL, refs: list[weakref.ref], parts: int) -> None:
    _lowest_priority()
    extents = []
    for ref in refs:
        tensor = ref()
        extents.append((0, 0) if tensor is None else (tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        del tensor
    for i, addr, n in populate_order(extents, parts, os.sysconf("SC_PAGE_SIZE")):
        tensor = refs[i]()    # keeps the memory mapped during the call
        if tensor is None:
            continue
        rc = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(n), MADV_POPULATE_WRITE)
        del tensor
        if rc != 0:
            logger.debug("KV cache prefault stopped: madvise: %s", os.strerror(ctypes.get_errno()))
            return
