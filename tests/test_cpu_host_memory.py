"""host_memory.py: the KV cache's pages are mapped in the background without
changing what the engine wrote, on huge pages where the kernel has them, and freed
temporaries stop faulting."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import subprocess
import sys

import pytest
import torch

from polyrunner.backends.cpu import host_memory

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise/mincore are Linux's")


def resident_fraction(t: torch.Tensor) -> float:
    """Share of `t`'s whole pages that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    n = (end - start) // page
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) / n


def populate_supported() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = torch.empty(1 << 16, dtype=torch.uint8)
    page = os.sysconf("SC_PAGE_SIZE")
    addr = -(-buf.data_ptr() // page) * page
    return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(page), host_memory.MADV_POPULATE_WRITE) == 0


@linux
def test_prefault_maps_every_page_and_keeps_the_contents():
    if not populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    maps = [mmap.mmap(-1, 40 << 20) for _ in range(2)]          # fresh anonymous pages, none resident yet
    caches = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    assert resident_fraction(caches[1]) < 0.5
    caches[0][:8192] = 7          # what the engine wrote before the thread got there
    caches[1][-100:] = 3
    thread = host_memory.prefault_in_background(caches)
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert resident_fraction(caches[0]) == 1.0 and resident_fraction(caches[1]) == 1.0
    assert bool((caches[0][:8192] == 7).all()) and bool((caches[1][-100:] == 3).all())


def test_populate_order_maps_low_blocks_of_every_part_first():
    """Two layers of two halves (K, V) each, 8 pages per half: every round maps the same
    offset of all four halves, so the lowest block ids are mapped first everywhere."""
    page = 4096
    extents = [(0, 16 * page), (100 * page + 10, 16 * page)]   # the second starts mid-page
    calls = list(host_memory.populate_order(extents, parts=2, page=page, chunk=8 * page))
    assert calls[:4] == [(0, 0, 2 * page), (0, 8 * page, 2 * page), (1, 101 * page, 2 * page),
                         (1, 109 * page, 2 * page)]
    assert calls[4][2] == 2 * page and calls[4][1] == 2 * page
    mapped = {(i, a + k * page) for i, a, n in calls for k in range(n // page)}
    # every whole page of every half, once; the partial pages at the second tensor's ends are left
    whole = {(0, a) for a in range(0, 16 * page, page)} | {(1, a) for a in range(101 * page, 108 * page, page)} \
        | {(1, a) for a in range(109 * page, 116 * page, page)}
    assert mapped == whole and len(mapped) == sum(n // page for _, _, n in calls)


@linux
def test_prefault_skips_tensors_freed_meanwhile():
    caches = [torch.empty(8 << 20, dtype=torch.uint8)]
    refs_only = host_memory.prefault_in_background([torch.empty(8 << 20, dtype=torch.uint8), *caches])
    gc.collect()
    refs_only.join(timeout=60)
    assert not refs_only.is_alive()
    assert host_memory.prefault_in_background([]) is None


def huge_page_advised(t: torch.Tensor) -> bool:
    """Whether the mapping that holds `t`'s 2 MiB-aligned interior carries MADV_HUGEPAGE ("hg")."""
    addr = host_memory.round_up(t.data_ptr(), host_memory.HUGE_PAGE)
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


@linux
def test_huge_pages_are_advised_where_the_kernel_has_them():
    big = torch.empty(64 << 20, dtype=torch.uint8)   # a fresh mapping (above keep_freed_memory's mmap threshold)
    small = torch.empty(1 << 20, dtype=torch.uint8)     # no whole 2 MiB page inside
    if host_memory.thp_mode() is None:
        assert not host_memory.advise_huge_pages(big)
        return
    assert host_memory.advise_huge_pages(big) and huge_page_advised(big)
    assert not host_memory.advise_huge_pages(small)


@linux
def test_cpu_backend_asks_for_huge_pages_in_its_kv_cache():
    if host_memory.thp_mode() is None:
        pytest.skip("this kernel has no transparent huge pages")
    from polyrunner.backends.cpu.plugin import CPUBackend
    from polyrunner.config import CacheConfig, EngineConfig, ModelConfig
    from polyrunner.device.kv_spec import KVCacheSpec
    backend = CPUBackend(EngineConfig(model=ModelConfig(), cache=CacheConfig()))
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_size=64, block_size=16, dtype=torch.bfloat16)
    caches = backend.allocate_kv_cache(spec, num_blocks=1024)     # 8 MiB per layer
    assert all(huge_page_advised(c) for c in caches)
    assert all(bool((c[:, 0] == 0).all()) for c in caches)        # the null block still zeroed


@linux
@pytest.mark.parametrize("prefault", [False, True])
def test_cpu_backend_prefaults_its_kv_cache_when_asked(monkeypatch, prefault):
    from polyrunner.backends.cpu.plugin import CPUBackend
    from polyrunner.config import CacheConfig, EngineConfig, ModelConfig
    from polyrunner.device.kv_spec import KVCacheSpec
    started = []
    monkeypatch.setattr("polyrunner.backends.cpu.plugin.prefault_in_background",
                        lambda caches, parts: started.append((caches, parts)))
    backend = CPUBackend(EngineConfig(model=ModelConfig(), cache=CacheConfig(prefault_kv_cache=prefault)))
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.bfloat16)
    caches = backend.allocate_kv_cache(spec, num_blocks=3)
    if prefault:
        assert len(started) == 1 and [c.data_ptr() for c in started[0][0]] == [c.data_ptr() for c in caches]
        assert started[0][1] == 2 and caches[0].shape[0] == 2   # K and V halves, mapped side by side
    else:
        assert started == []


@linux
def test_cpu_backend_waits_for_its_kv_prefault():
    """`wait_kv_cache_mapped` joins the background prefault of the cache it allocated (every page
    resident afterwards), and answers at once where nothing maps in the background."""
    if not populate_supported():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    from polyrunner.backends.cpu.plugin import CPUBackend
    from polyrunner.config import CacheConfig, EngineConfig, ModelConfig
    from polyrunner.device.kv_spec import KVCacheSpec
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_size=64, block_size=16, dtype=torch.bfloat16)
    lazy = CPUBackend(EngineConfig(model=ModelConfig(), cache=CacheConfig()))
    lazy.allocate_kv_cache(spec, num_blocks=1024)
    assert lazy.wait_kv_cache_mapped(0.0)
    backend = CPUBackend(EngineConfig(model=ModelConfig(), cache=CacheConfig(prefault_kv_cache=True)))
    caches = backend.allocate_kv_cache(spec, num_blocks=1024)     # 8 MiB per layer
    thread = backend._kv_prefault
    assert thread is not None and thread.name == "polyrunner-kv-prefault"
    assert backend.wait_kv_cache_mapped(60.0) and not thread.is_alive()
    assert all(resident_fraction(c) == 1.0 for c in caches)


def test_benchmark_runs_start_with_the_kv_cache_mapped(monkeypatch):
    """`polyrunner bench`'s timed runs: the engine asked to prefault, and waited for."""
    from types import SimpleNamespace

    from polyrunner.tools.bench import run
    made, waited = [], []
    backend = SimpleNamespace(wait_kv_cache_mapped=lambda timeout: waited.append(timeout) or True)
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(backend=backend)))
    monkeypatch.setattr(run, "make_llm", lambda model, eager, **options: made.append(options) or llm)
    monkeypatch.setattr(run, "run_workload", lambda llm, w, repeats: (waited and w.name))
    assert run.run_all_workloads(["w3"], 1, dtype="bfloat16") == ["w3"]
    assert made == [{"prefault_kv_cache": True, "dtype": "bfloat16"}] and len(waited) == 1
    backend.wait_kv_cache_mapped = lambda timeout: False
    with pytest.raises(RuntimeError, match="not mapped"):
        run.map_kv_cache(llm, 0.1)


def test_serve_prefaults_and_the_library_does_not():
    import inspect

    from polyrunner import LLM
    from polyrunner.config import CacheConfig
    from polyrunner.tools.cli import build_parser
    assert CacheConfig().prefault_kv_cache is False
    assert inspect.signature(LLM).parameters["prefault_kv_cache"].default is False
    parser = build_parser()
    assert parser.parse_args(["serve"]).prefault_kv_cache is True
    assert parser.parse_args(["serve", "--no-prefault-kv-cache"]).prefault_kv_cache is False


FAULTS_PER_CALL = """
import resource, sys, torch
from polyrunner.backends.cpu import host_memory
if sys.argv[1] == "keep" and not host_memory.keep_freed_memory():
    print("no-glibc"); raise SystemExit
torch.set_num_threads(1)
x = torch.randn(64, 49152).bfloat16()     # the logits of 64 rows: a 12 MiB float32 temporary
for _ in range(3):
    x.float()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    x.float()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


@linux
def test_freed_temporaries_stop_faulting():
    """With glibc trimming every free (a small trim threshold, as a fragmented heap
    ends up behaving) each 12 MiB temporary faults all of its 3072 pages in again;
    keep_freed_memory stops that."""
    def faults(mode: str) -> str:
        env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="131072")
        out = subprocess.run([sys.executable, "-c", FAULTS_PER_CALL, mode], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()
    kept = faults("keep")
    if kept == "no-glibc":
        pytest.skip("not glibc")
    assert float(faults("default")) > 2000       # the scenario does fault
    assert float(kept) < 3072 / 4, f"{kept} page faults per 12 MiB temporary (3072 pages)"
