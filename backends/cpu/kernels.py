"""Build and load the CPU kernels: paged attention and fused elementwise ops
(`paged_attention.cpp`), the AMX, AVX512_BF16 and AVX-512F linears (`linear_amx.cpp`, `linear_bf16.cpp`,
`linear_avx512.cpp`; which one a step runs is measured, `kernel_table.py`).

The kernels are plain C++ compiled into one library once per (sources, flags, compiler, CPU) into
`~/.cache/polyrunner/cpu_kernels/` (`POLYRUNNER_CACHE`) and called through ctypes with raw pointers.
The first build is logged at INFO with its time (seconds: one compiler per source, in parallel;
figures in benchmarks/results/design-measurements.md); a cached library loads in milliseconds.
Without a C++ compiler, or with
`POLYRUNNER_CPU_KERNELS=0`, `paged_attention_kernel()` returns None and the
backend falls back to the reference attention (with a warning), unfused
modules and oneDNN alone for the linears.

Two builds (`VARIANTS`): "native" (`-march=native`: the AVX-512 BF16 paths and
the AMX linear where the CPU has them) and "portable" (`-DPR_PORTABLE`, and no
AVX-512 on x86: the plain loops an AVX2-only CPU runs, no AMX).
`POLYRUNNER_CPU_SIMD=0` makes the backend use the portable one;
`use_kernels(variant)` switches for a block (tests run every path on every CPU).
A third, "vnni_emulated", is for tests only: AVX2 code in which the quantized linears' AVX-VNNI and
AVX-512 VNNI paths are compiled with `vpdpbusd` emulated exactly (quant_common.h), so that a CPU
without VNNI tests those paths' logic.

`paged_attention(...)` is also registered as the torch custom op
`polyrunner_cpu::paged_attention` (mutating the KV cache and the output), so a
`torch.compile`d model keeps it as one opaque call.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from polyrunner.backends.cpu import envs
from polyrunner.backends.cpu.kernel_calls import call
from polyrunner.plugin_api import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
SOURCES = [SOURCE, Path(__file__).with_name("linear_amx.cpp"),  # built into one library
           Path(__file__).with_name("linear_bf16.cpp"), Path(__file__).with_name("thread_pool.cpp"),
           Path(__file__).with_name("argmax.cpp")]
SOURCES += [Path(__file__).with_name(f"quant_{name}.cpp")  # GGUF-quantized linears (quant_linear.py), rows
            for name in ("gemm", "kquants", "kquants_r8", "small", "small_r8", "rows")]
SOURCES += [Path(__file__).with_name("graph_replay.cpp")]  # CPU graphs' replayer (graphs.py)
SOURCES += [Path(__file__).with_name("prefill_attention.cpp")]  # bfloat16 prefill attention (attention.py)
SOURCES += [Path(__file__).with_name("moe_experts.cpp")]  # the "moe" role's one call per layer (moe_module.py)
SOURCES += [Path(__file__).with_name("lora_kernel.cpp")]  # the "lora" role's one call per linear (lora_module.py)
SOURCES += [Path(__file__).with_name("linear_avx512.cpp")]  # AVX-512F bfloat16 linear (no AVX512_BF16)
SOURCES += [Path(__file__).with_name("fused_elementwise.cpp")]  # fused norms, SiLU * up, rotary (fused_modules.py)
HEADERS = [Path(__file__).with_name("thread_pool.h"),   # included by the sources (part of the build key)
           Path(__file__).with_name("simd_exp.h"), Path(__file__).with_name("amx_tiles.h"),
           Path(__file__).with_name("widen_dot.h"), Path(__file__).with_name("weight_prefetch.h"),
           Path(__file__).with_name("micro_pick.h"), Path(__file__).with_name("quant_common.h"),
           Path(__file__).with_name("bfloat16.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
         "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-freciprocal-math"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
VARIANTS = {"native": [], "portable": ["-DPR_PORTABLE", *(["-mno-avx512f"] if _X86 else [])],
            "vnni_emulated": ["-DPRQ_EMULATE_VNNI", *(["-mno-avx512f", "-mno-avxvnni"] if _X86 else [])]}

# CPU-seconds of one compile of every source (g++ 12, -O3, 2-core Xeon: 9.5 s as one g++ call on an idle
# host), and the largest file's share (paged_attention.cpp, ~1/3): the first-run estimate in the log
COMPILE_CPU_SECONDS, LARGEST_SHARE = 10.0, 0.35

_lock, _lock_variant = threading.Lock(), threading.Lock()
_lib: ctypes.CDLL | None = None  # the library the backend calls (`paged_attention_kernel()`)
_tried = False
_loaded: dict[str, ctypes.CDLL | None] = {}  # per variant


def cache_dir() -> Path:
    """`cache_root()/cpu_kernels` (`POLYRUNNER_CACHE`, else the XDG or home cache)."""
    return cache_root() / "cpu_kernels"


def _cpu_signature() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build(compiler: str, flags: list[str]) -> Path:
    """The library for `flags`, compiled into `cache_dir()` unless already there (INFO lines
    before and after a compile, with its time; a cache hit is logged at DEBUG)."""
    src = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(src + " ".join(flags).encode() + version.encode() + _cpu_signature().encode())
    target = cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"
    if target.is_file():
        logger.debug("CPU kernels: cached %s", target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    jobs = _jobs()
    logger.info("compiling CPU kernels (%s; %d jobs) into %s; first run only, ~%.0f s on idle cores",
                " ".join(flags), jobs, target.parent, COMPILE_CPU_SECONDS * max(1 / jobs, LARGEST_SHARE))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        _compile(compiler, flags, Path(tmp), out, jobs)
        os.replace(out, target)  # atomic: concurrent builders agree on the result
    logger.info("compiled CPU kernels in %.1f s: %s", time.perf_counter() - start, target)
    return target


def _jobs() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, len(SOURCES)))


def _compile(compiler: str, flags: list[str], tmp: Path, out: Path, jobs: int) -> None:
    """Compile each source to an object file (`jobs` compilers at a time, largest first), then link
    them into `out`; RuntimeError with the compiler's message on a failure."""
    objects = {src: tmp / f"{i}-{src.stem}.o" for i, src in enumerate(SOURCES)}
    compile_flags = [f for f in flags if f != "-shared"]

    def run(cmd: list[str]) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")

    order = sorted(SOURCES, key=lambda p: p.stat().st_size, reverse=True)
    with ThreadPoolExecutor(jobs) as pool:
        for done in [pool.submit(run, [compiler, *compile_flags, "-c", str(src), "-o", str(objects[src])])
                     for src in order]:
            done.result()
    run([compiler, *flags, *map(str, objects.values()), "-o", str(out)])


def paged_attention_kernel() -> ctypes.CDLL | None:
    """The kernel library the backend calls, built on first use: the "portable"
    variant with `POLYRUNNER_CPU_SIMD=0`, else "native"; None when unavailable
    (`POLYRUNNER_CPU_KERNELS=0`, no compiler, a failed build)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if envs.KERNELS.get():
                _lib = load_library("native" if envs.SIMD.get() else "portable")
            _tried = True
    return _lib


def load_library(variant: str = "native") -> ctypes.CDLL | None:
    """The kernel library built with `VARIANTS[variant]`, loaded once per process;
    None without a C++ compiler or when the build or load fails (logged)."""
    with _lock_variant:
        if variant in _loaded:
            return _loaded[variant]
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        lib = None
        if compiler is None:
            logger.warning("no C++ compiler found: the CPU backend uses the slow reference attention")
        else:
            try:
                torch.set_num_threads(torch.get_num_threads())  # load torch's OpenMP runtime first
                lib = _declare(ctypes.CDLL(str(_build(compiler, FLAGS + VARIANTS[variant]))))
            except Exception as exc:  # noqa: BLE001 - any build/load failure means "use the fallback"
                logger.warning("CPU attention kernel unavailable (%s): using the reference attention", exc)
        _loaded[variant] = lib
        return lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the argument and result types of the library's functions."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = lib.pr_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64,
                   ptr, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, ctypes.c_float, i64, ctypes.c_float]
    lib.pr_simd_bf16.restype = ctypes.c_int
    lib.pr_simd_f32.restype = ctypes.c_int
    lib.pr_set_decode_prefetch.restype = ctypes.c_int
    lib.pr_set_decode_prefetch.argtypes = [ctypes.c_int]
    lib.pr_set_linear_prefetch.restype = ctypes.c_int
    lib.pr_set_linear_prefetch.argtypes = [ctypes.c_int]
    lib.pr_linear_prefetch.restype = ctypes.c_int
    lib.pr_linear_prefetch.argtypes = []
    lib.pr_softcap_scores.restype = ctypes.c_int
    lib.pr_softcap_scores.argtypes = [ptr, ptr, i64, ctypes.c_float, ctypes.c_int]
    c_int, c_float = ctypes.c_int, ctypes.c_float
    for name, args in (("pr_rms_norm", [c_int, ptr, i64, ptr, ptr, i64, i64, i64, c_float]),
                       ("pr_add_rms_norm", [c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, c_float]),
                       ("pr_silu_mul", [c_int, ptr, i64, ptr, i64, i64, i64]),
                       ("pr_rotary", [c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, i64])):
        getattr(lib, name).restype, getattr(lib, name).argtypes = c_int, args
    lib.pr_amx_init.restype = ctypes.c_int
    lib.pr_amx_pack_bf16.restype = None
    lib.pr_amx_pack_bf16.argtypes = [ptr, ptr, i64, i64]
    lib.pr_amx_linear_bf16.restype = ctypes.c_int
    lib.pr_amx_linear_bf16.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64]
    lib.pr_pool_start.restype = ctypes.c_int
    lib.pr_pool_start.argtypes = [ctypes.c_int, ptr, ctypes.c_int, ctypes.c_int]
    lib.pr_pool_helpers.restype = ctypes.c_int
    lib.pr_pool_set_active.restype = ctypes.c_int
    lib.pr_pool_set_active.argtypes = [ctypes.c_int]
    lib.pr_pool_set_spin.restype = None
    lib.pr_pool_set_spin.argtypes = [ctypes.c_int]
    lib.pr_argmax_f32.restype = None
    lib.pr_argmax_f32.argtypes = [ptr, i64, i64, i64, ptr]
    lib.pr_dpbf16_available.restype = ctypes.c_int
    lib.pr_dpbf16_pack_bf16.restype = None
    lib.pr_dpbf16_pack_bf16.argtypes = [ptr, ptr, i64, i64]
    lib.pr_dpbf16_linear_bf16.restype = ctypes.c_int
    lib.pr_dpbf16_linear_bf16.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64]
    lib.pr_avx512_available.restype = ctypes.c_int
    lib.pr_avx512_packed_size.restype = i64
    lib.pr_avx512_packed_size.argtypes = [i64, i64]
    lib.pr_avx512_pack_bf16.restype = None
    lib.pr_avx512_pack_bf16.argtypes = [ptr, ptr, i64, i64]
    lib.pr_avx512_linear_bf16.restype = ctypes.c_int
    lib.pr_avx512_linear_bf16.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, i64, i64, i64, i64]
    lib.pr_prefill_attention_bf16.restype = ctypes.c_int
    lib.pr_prefill_attention_bf16.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64,
                                              i64, i64, ctypes.c_float, i64, ctypes.c_float, i64]
    lib.pr_prefill_attention_amx.restype = ctypes.c_int
    lib.pr_gather_rows.restype = None
    lib.pr_gather_rows.argtypes = [ptr, i64, ptr, i64, ptr]
    lib.pr_moe.restype = ctypes.c_int
    lib.pr_moe.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                           i64, ctypes.c_int, ctypes.c_int, ptr, i64]
    lib.pr_moe_scratch_bytes.restype = i64
    lib.pr_moe_scratch_bytes.argtypes = [i64, i64, i64, i64, i64]
    lib.pr_moe_simd.restype = ctypes.c_int
    lib.pr_lora.restype = ctypes.c_int
    lib.pr_lora.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                            ptr, i64]
    lib.pr_lora_scratch_bytes.restype = i64
    lib.pr_lora_scratch_bytes.argtypes = [i64, i64, i64, i64, i64]
    lib.pr_lora_simd.restype = ctypes.c_int
    lib.pr_lora_embed.restype = ctypes.c_int
    lib.pr_lora_embed.argtypes = [ctypes.c_int, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64]
    lib.pr_replay.restype = i64
    lib.pr_replay.argtypes = [ptr, i64]
    lib.pr_replay_timed.restype = i64
    lib.pr_replay_timed.argtypes = [ptr, i64, ptr]
    lib.pr_replay_kernel_name.restype = ctypes.c_char_p
    lib.pr_replay_kernel_name.argtypes = [ctypes.c_int]
    _declare_quant(lib)
    return lib


def _declare_quant(lib: ctypes.CDLL) -> None:
    """The GGUF-quantized kernels' types (quant_linear.py, quant_embedding.py, moe_module.py)."""
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.pr_quant_isa_compiled.argtypes = [i32]
    lib.pr_quant_isa_compiled.restype = i32
    lib.pr_quant_best_isa.restype = i32
    lib.pr_quant_linear.argtypes = [i32, ptr, i64, i64, ptr, i64, i32, i64, ptr, i64, i32, i32]
    lib.pr_quant_linear.restype = i32
    lib.pr_quant_dequantize.argtypes = [i32, ptr, i64, i64, ptr, i32]
    lib.pr_quant_dequantize.restype = i32
    lib.pr_quant_r8_supported.argtypes = [i32]
    lib.pr_quant_r8_supported.restype = i32
    lib.pr_quant_r8_isa.argtypes = [i32, i32]
    lib.pr_quant_r8_isa.restype = i32
    lib.pr_quant_r8_bytes.argtypes = [i32, i64, i64]
    lib.pr_quant_r8_bytes.restype = i64
    lib.pr_quant_repack8.argtypes = [i32, ptr, i64, i64, ptr]
    lib.pr_quant_repack8.restype = i32
    lib.pr_quant_linear8.argtypes = lib.pr_quant_linear.argtypes
    lib.pr_quant_linear8.restype = i32
    lib.pr_quant_dequantize8.argtypes = lib.pr_quant_dequantize.argtypes
    lib.pr_quant_dequantize8.restype = i32
    lib.pr_quant_rows.argtypes = [i32, ptr, i32, i64, i64, ptr, i64, ptr, i64, i32]
    lib.pr_quant_rows.restype = i32
    lib.pr_moe_quant.argtypes = [i32, ptr, i64, ptr, i64, i32, i32, ptr, ptr, i32, i32, ptr, i32, i32, ptr, i64,
                                 i64, i64, i64, i64, i64, i32, i32, ptr, i64]
    lib.pr_moe_quant.restype = i32
    lib.pr_moe_quant_scratch_bytes.argtypes = [i64, i64, i64, i64, i64]
    lib.pr_moe_quant_scratch_bytes.restype = i64


@contextlib.contextmanager
def use_kernels(variant: str | None):
    """Run the block with the `variant` library ("native", "portable"; None: none,
    i.e. the reference fallbacks) as the backend's; AMX and AVX512_BF16 are probed again. Modules
    built inside keep what they chose (e.g. a PackedLinear's AMX copy)."""
    global _lib, _tried, _amx, _dpbf16, _avx512
    saved = _lib, _tried, _amx, _dpbf16, _avx512
    _lib, _tried, _amx, _dpbf16, _avx512 = (load_library(variant) if variant else None), True, None, None, None
    try:
        yield _lib
    finally:
        _lib, _tried, _amx, _dpbf16, _avx512 = saved


def simd_bf16(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library (default: the backend's) has the AVX-512 BF16 paths."""
    lib = lib if lib is not None else paged_attention_kernel()
    return lib is not None and lib.pr_simd_bf16() == 1


def simd_f32(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library (default: the backend's) has the float32 decode attention's AVX2 path."""
    lib = lib if lib is not None else paged_attention_kernel()
    return lib is not None and lib.pr_simd_f32() == 1


def kernel_supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (q.dtype in DTYPES and kv_cache.dtype == q.dtype and kv_cache.is_contiguous()
            and paged_attention_kernel() is not None)


def call_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, num_write: int, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor,
                r_begin: int, r_end: int, scale: float, window: int, softcap: float = 0.0) -> None:
    """Write `num_write` tokens' k/v into their slots, then attend requests
    [r_begin, r_end) into `out` (any number of queries each; `softcap` > 0: scores become
    softcap * tanh(score / softcap), 0: none). Tensors as in `paged_attention.cpp`; q, k, v and
    out need unit stride on the head dim and head stride D."""
    _, NB, bs, Hkv, D = kv_cache.shape
    Hq = q.shape[1]
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out")):
        if t.stride(-1) != 1 or t.stride(-2) != D:
            raise ValueError(f"{name} must have unit stride on the last dim and head stride {D}")
    rc = call(
        _lib.pr_paged_attention, DTYPES[q.dtype], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
        v.data_ptr(), v.stride(0), kv_cache.data_ptr(), NB, bs, Hq, Hkv, D, slot_mapping.data_ptr(), num_write,
        query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        out.data_ptr(), out.stride(0), r_begin, r_end, scale, window, float(softcap))
    if rc != 0:
        raise RuntimeError(f"CPU paged attention kernel failed (code {rc})")


def prefill_attention_bf16(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor,
                           r_begin: int, r_end: int, scale: float, window: int, amx: bool = False,
                           softcap: float = 0.0) -> bool:
    """Attend requests [r_begin, r_end) (their keys and values already in the cache) into
    `out` with `prefill_attention.cpp` (`amx`: its AMX variant; `softcap` as `call_kernel`'s);
    False when it does not run here
    (not bfloat16, head dim not 64/128, no AVX512_BF16 (or AMX) build,
    `POLYRUNNER_CPU_PREFILL_KERNEL=0`): use SDPA."""
    if (q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16 or _lib is None
            or not envs.PREFILL_KERNEL.get()):
        return False
    _, NB, bs, Hkv, D = kv_cache.shape
    if q.stride(-1) != 1 or q.stride(-2) != D or out.stride(-1) != 1 or out.stride(-2) != D:
        return False
    return call(   # (not replayable: a capture that reached it would fail, not skip it)
        _lib.pr_prefill_attention_bf16, q.data_ptr(), q.stride(0), kv_cache.data_ptr(), NB, bs, q.shape[1], Hkv, D,
        query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        out.data_ptr(), out.stride(0), r_begin, r_end, scale, window, float(softcap), int(amx)) == 0


def prefill_attention_amx_reason() -> str | None:
    """None when the AMX prefill attention can run here, else why not."""
    if not amx_available():
        return amx_unavailable_reason()
    if _lib is None or not _lib.pr_prefill_attention_amx():
        return "this kernel build has no AMX prefill attention"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face RMSNorm of a 2-D float32 or bfloat16 `x` (unit stride on the last dim; `weight` in its dtype)."""
    T, H = x.shape
    out = torch.empty((T, H), dtype=x.dtype)
    call(_lib.pr_rms_norm, DTYPES[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
         out.stride(0), T, H, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)` for contiguous 2-D x and residual of one dtype (`rms_norm`'s)."""
    T, H = x.shape
    out, r = torch.empty((T, H), dtype=x.dtype), torch.empty((T, H), dtype=x.dtype)
    call(_lib.pr_add_rms_norm, DTYPES[x.dtype], x.data_ptr(), residual.data_ptr(), weight.data_ptr(), r.data_ptr(),
         out.data_ptr(), T, H, eps)
    return out, r


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the two halves of a 2-D float32 or bfloat16 `gate_up` (unit stride on the last dim)."""
    T, I2 = gate_up.shape
    out = torch.empty((T, I2 // 2), dtype=gate_up.dtype)
    call(_lib.pr_silu_mul, DTYPES[gate_up.dtype], gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(),
         out.stride(0), T, I2 // 2)
    return out


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q `[T, Hq, D]` and k `[T, Hkv, D]` (float32 or bfloat16, one dtype) in place at int64 `positions`
    (Hugging Face roundings); cos/sin: contiguous float32 `[P, D]`, D <= 512 and even."""
    T, Hq, D = q.shape
    call(_lib.pr_rotary, DTYPES[q.dtype], q.data_ptr(), q.stride(0), Hq, k.data_ptr(), k.stride(0), k.shape[1],
         positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, D)


_amx: bool | None = None
_dpbf16: bool | None = None
_avx512: bool | None = None


def amx_available() -> bool:
    """Whether the AMX linear can run here (kernel built with AMX, tiles granted)."""
    global _amx
    if _amx is None:
        _amx = amx_unavailable_reason() is None
    return _amx


def amx_unavailable_reason() -> str | None:
    """None when the AMX linear can run here, else why not."""
    if not envs.AMX.get():
        return "POLYRUNNER_CPU_AMX=0"
    lib = paged_attention_kernel()
    if lib is None:
        return "no CPU kernel library (no C++ compiler, or POLYRUNNER_CPU_KERNELS=0)"
    rc = lib.pr_amx_init()
    if rc == 0:
        return None
    if rc == 2:
        return "Linux refused this process the AMX tile state (arch_prctl)"
    if lib is _loaded.get("portable"):
        return "the portable kernel build has no AMX code"
    return "the native kernel build has no AMX code: this CPU lacks AMX-TILE/AMX-BF16"


def amx_pack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] bfloat16 in the AMX tile layout of `linear_amx.cpp`; None
    unless N % 16 == 0 and K % 32 == 0."""
    N, K = weight.shape
    if N % 16 or K % 32 or weight.dtype != torch.bfloat16:
        return None
    w = weight.detach().contiguous()
    packed = torch.empty(N * K, dtype=torch.bfloat16)
    _lib.pr_amx_pack_bf16(w.data_ptr(), packed.data_ptr(), N, K)
    return packed


def amx_linear_bf16(x: torch.Tensor, packed: torch.Tensor, N: int) -> torch.Tensor | None:
    """x[M, K] @ W^T, W packed by `amx_pack_bf16` (x: bfloat16, unit stride on K);
    None when the kernel declines."""
    M, K = x.shape
    if x.stride(1) != 1 or x.dtype != torch.bfloat16:
        return None
    y = torch.empty((M, N), dtype=torch.bfloat16)
    if call(_lib.pr_amx_linear_bf16, x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), N, M, N, K):
        return None
    return y


def start_pool(threads: int, cpus: list[int] | None = None, spin_us: int = 200) -> int:
    """(Re)start the decode kernels' thread pool (`thread_pool.cpp`) for `threads`
    threads in all (the caller plus helpers allowed on `cpus`); returns the helpers
    started (0 without the kernel library)."""
    lib = paged_attention_kernel()
    if lib is None:
        return 0
    cpus = list(cpus or [])
    arr = (ctypes.c_int * max(1, len(cpus)))(*cpus)
    return lib.pr_pool_start(max(1, threads), arr, len(cpus), spin_us)


def argmax_f32(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` (first maximum, NaN counting as the maximum) of a 2-D
    float32 tensor with unit stride on the last dim, by `argmax.cpp`; torch's own
    argmax for anything else or without the kernel library."""
    lib = paged_attention_kernel()
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1
            or logits.shape[1] == 0 or logits.device.type != "cpu"):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.pr_argmax_f32(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def set_pool_threads(threads: int) -> int:
    """Let `threads` of the pool's threads (caller included) take part in the next
    calls (clamped to the pool's size); the rest sleep. Returns the number set."""
    lib = paged_attention_kernel()
    return 1 if lib is None else lib.pr_pool_set_active(threads)


def set_decode_prefetch(l2: bool) -> bool:
    """Where the bfloat16 decode attention prefetches the next KV block (`decode_prefetch.py`):
    into L2 (True) or L1 (False); returns the previous setting."""
    lib = paged_attention_kernel()
    return False if lib is None else bool(lib.pr_set_decode_prefetch(int(l2)))


def set_linear_prefetch(l2: bool) -> bool:
    """Where the pool's bfloat16 linears prefetch their weights (`linear_prefetch.py`): into L2
    (True) or L1 (False); returns the previous setting."""
    lib = paged_attention_kernel()
    return False if lib is None else bool(lib.pr_set_linear_prefetch(int(l2)))


def linear_prefetch_l2() -> bool:
    """Whether the pool's bfloat16 linears prefetch into L2 now (see `set_linear_prefetch`)."""
    lib = paged_attention_kernel()
    return lib is not None and bool(lib.pr_linear_prefetch())


def set_pool_spin(spin_us: int) -> None:
    """How long idle pool helpers spin after a job before sleeping (0: at once)."""
    lib = paged_attention_kernel()
    if lib is not None:
        lib.pr_pool_set_spin(spin_us)


def dpbf16_available() -> bool:
    """Whether the AVX512_BF16 linear can run here."""
    global _dpbf16
    if _dpbf16 is None:
        _dpbf16 = dpbf16_unavailable_reason() is None
    return _dpbf16


def dpbf16_unavailable_reason() -> str | None:
    """None when the AVX512_BF16 small-M linear (`linear_bf16.cpp`) can run here, else why not."""
    if not envs.DPBF16.get():
        return "POLYRUNNER_CPU_DPBF16=0"
    lib = paged_attention_kernel()
    if lib is None:
        return "no CPU kernel library (no C++ compiler, or POLYRUNNER_CPU_KERNELS=0)"
    if lib.pr_dpbf16_available() == 1:
        return None
    if lib is _loaded.get("portable"):
        return "the portable kernel build has no AVX512_BF16 code"
    return "the native kernel build has no AVX512_BF16 code: this CPU lacks AVX512F + AVX512_BF16"


def dpbf16_pack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] bfloat16 in the layout of `linear_bf16.cpp`; None unless
    N % 16 == 0 and K % 2 == 0."""
    N, K = weight.shape
    if N % 16 or K % 2 or weight.dtype != torch.bfloat16:
        return None
    w = weight.detach().contiguous()
    packed = torch.empty(N * K, dtype=torch.bfloat16)
    _lib.pr_dpbf16_pack_bf16(w.data_ptr(), packed.data_ptr(), N, K)
    return packed


def dpbf16_linear_bf16(x: torch.Tensor, packed: torch.Tensor, N: int) -> torch.Tensor | None:
    """x[M, K] @ W^T with W packed by `dpbf16_pack_bf16`, on AVX512_BF16 dot products
    (x: bfloat16, unit stride on K); None when the kernel declines."""
    M, K = x.shape
    if x.stride(1) != 1 or x.dtype != torch.bfloat16:
        return None
    y = torch.empty((M, N), dtype=torch.bfloat16)
    if call(_lib.pr_dpbf16_linear_bf16, x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), N, M, N, K):
        return None
    return y


def avx512_available() -> bool:
    """Whether the AVX-512F bfloat16 linear (`linear_avx512.cpp`) can run here."""
    global _avx512
    if _avx512 is None:
        _avx512 = avx512_unavailable_reason() is None
    return _avx512


def avx512_unavailable_reason() -> str | None:
    """None when the AVX-512F linear can run here, else why not."""
    if not envs.AVX512.get():
        return "POLYRUNNER_CPU_AVX512=0"
    lib = paged_attention_kernel()
    if lib is None:
        return "no CPU kernel library (no C++ compiler, or POLYRUNNER_CPU_KERNELS=0)"
    if lib.pr_avx512_available() == 1:
        return None
    if lib is _loaded.get("portable"):
        return "the portable kernel build has no AVX-512 code"
    return "the native kernel build has no AVX-512 code: this CPU lacks AVX512F"


def avx512_pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] bfloat16 in the layout of `linear_avx512.cpp` (any N, K: zero-padded)."""
    N, K = weight.shape
    w = weight.detach().to(torch.bfloat16).contiguous()
    packed = torch.empty(_lib.pr_avx512_packed_size(N, K), dtype=torch.bfloat16)
    _lib.pr_avx512_pack_bf16(w.data_ptr(), packed.data_ptr(), N, K)
    return packed


def avx512_linear_bf16(x: torch.Tensor, packed: torch.Tensor, N: int) -> torch.Tensor | None:
    """x[M, K] @ W^T -> bfloat16 [M, N], W packed by `avx512_pack_bf16`, by AVX-512F float32 FMAs
    (x: bfloat16 or float32, unit stride on K); None when the kernel declines."""
    M, K = x.shape
    if x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float32):
        return None
    y = torch.empty((M, N), dtype=torch.bfloat16)
    if call(_lib.pr_avx512_linear_bf16, x.data_ptr(), x.stride(0), int(x.dtype == torch.float32), packed.data_ptr(),
            y.data_ptr(), N, M, N, K):
        return None
    return y


@torch.library.custom_op("polyrunner_cpu::paged_attention", mutates_args=("kv_cache", "out"))
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       block_tables: torch.Tensor, out: torch.Tensor, scale: float, window: int,
                       softcap: float = 0.0) -> None:
    """All tokens written, all requests attended (padded requests have seq_len 0)."""
    call_kernel(q, k, v, kv_cache, slot_mapping, slot_mapping.shape[0], query_start_loc, seq_lens,
                block_tables, out, 0, seq_lens.shape[0], scale, window, softcap)


@paged_attention_op.register_fake
def _(q, k, v, kv_cache, slot_mapping, query_start_loc, seq_lens, block_tables, out, scale, window, softcap=0.0):
    return None
