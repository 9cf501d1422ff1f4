import os
import random
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# Tiny test models are dominated by per-op overhead; one intra-op thread avoids
# OpenMP barrier stalls when the machine is shared (a 2-core CI box).
torch.set_num_threads(1)

# Outputs compared run to run must not follow the machine's load: under POLYRUNNER_CPU_THREADS=auto
# the CPU backend's thread governor re-reads other processes' load as steps run, and oneDNN's float32
# sums change with the thread count. The suite runs at a fixed count, one per physical core (what
# "auto" grants an idle machine); the governor has its own tests (test_cpu_fast_paths.py).
from polyrunner.backends.cpu.threads import physical_cpus  # noqa: E402

os.environ.setdefault("POLYRUNNER_CPU_THREADS", str(max(1, len(physical_cpus()))))

# Without a GPU, Triton kernels (tests/test_triton_*.py) run under Triton's interpreter; it must be
# on before anything imports triton (torch may import it on its own, e.g. with torch._dynamo).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from backend_plugin import BackendPlugin  # noqa: E402
from markers import MODULE_MARKERS  # noqa: E402
from tiny_models import build_tiny_model, model_cache  # noqa: E402

KINDS = ["llama", "llama_tied", "mistral", "qwen2", "qwen3"]


@pytest.fixture
def registered():
    """`registered(cls)` registers a plugin contributing backend class `cls` and returns its
    name; every plugin registered so is unregistered after the test."""
    from polyrunner.plugins import register
    from polyrunner.plugins.manager import unregister
    names = []

    def add(cls):
        name = f"test-backend-{cls.name}"
        register(BackendPlugin(cls), name=name)
        names.append(name)
        return cls.name

    yield add
    for name in names:
        unregister(name)


@pytest.fixture(autouse=True)
def _seed_global_rngs(request):
    """Every test starts Python's, numpy's and torch's global generators from a seed of its own
    (a hash of its file name and test id), so an unseeded `torch.randn` draws the same inputs on
    every run, machine and test order. Tests still pass their own generators where the values
    matter; this is the safety net (tests/tolerances.py: inputs fixed, tolerances derived)."""
    path, _, name = request.node.nodeid.partition("::")
    seed = zlib.crc32(f"{Path(path).name}::{name}".encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _kernel_build(param: str, simd: str):
    """Yields the kernel library of build `param`, active: "simd" the native build (skipped unless its
    `simd` paths, "bf16" or "decode", are compiled in for this CPU), "portable" the plain loops an
    AVX2-only CPU runs, built with -DPR_PORTABLE here."""
    from polyrunner.backends.cpu import kernels
    variant = "native" if param == "simd" else "portable"
    lib = kernels.load_library(variant)
    if lib is None:
        pytest.skip("no C++ compiler: the CPU kernel library is not built")
    if param == "simd" and not (kernels.simd_bf16(lib) or (simd == "decode" and kernels.simd_f32(lib))):
        pytest.skip(f"the native kernel build has no SIMD {simd} paths on this CPU (its plain loops are the "
                    "[portable] case)")
    with kernels.use_kernels(variant) as active:
        yield active


def _pool_threads(lib, n: int):
    """Yields n with the library's thread pool started with n threads (1: the caller alone)."""
    assert lib.pr_pool_start(n, None, 0, 200) == n - 1
    yield n
    lib.pr_pool_start(1, None, 0, 200)


@pytest.fixture(params=["simd", "portable"])
def cpu_kernels(request):
    """Runs the test once per C++ kernel build the CPU backend may use: "simd", the native build's
    AVX-512 BF16 paths (skipped where the CPU lacks them), and "portable". Yields the library."""
    yield from _kernel_build(request.param, "bf16")


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"threads{n}")
def pool_threads(request, cpu_kernels):
    """The library's thread pool started with that many threads (1: the caller alone)."""
    yield from _pool_threads(cpu_kernels, request.param)


@pytest.fixture(params=["simd", "portable"])
def decode_build(request):
    """The decode attention's builds: "simd", the native build where it has SIMD decode paths (AVX-512
    BF16, or the float32 AVX2 path an AVX2-only CPU runs), and "portable". Yields the library."""
    yield from _kernel_build(request.param, "decode")


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"threads{n}")
def decode_threads(request, decode_build):
    """`pool_threads` for `decode_build`."""
    yield from _pool_threads(decode_build, request.param)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    return model_cache(tmp_path_factory, build_tiny_model)


def pytest_collection_modifyitems(config, items):
    """Markers by module (tests/markers.py), so `make test-fast` can leave the slow modules out."""
    for item in items:
        for marker in MODULE_MARKERS.get(item.module.__name__.rpartition(".")[2], ()):
            item.add_marker(marker)
