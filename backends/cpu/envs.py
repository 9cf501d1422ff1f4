"""Environment variables of the CPU backend.

Declared through `polyrunner.envs`, which imports no torch; listed in the README.
"""

from __future__ import annotations

from polyrunner.envs import declare

_S = "cpu"

THREADS = declare("POLYRUNNER_CPU_THREADS", int, "auto",
                  "threads of the CPU backend; auto: one per physical core this process may use, less "
                  "those other processes keep busy; a number is capped at the CPUs this process may use",
                 choices=("auto",), ge=1, section=_S)
SMALL_STEP_THREADS = declare("POLYRUNNER_CPU_SMALL_STEP_THREADS", int, None,
                             "fixed thread count for steps of at most 16 tokens (clamped to 1.."
                             "POLYRUNNER_CPU_THREADS); unset: the same as other steps", section=_S)
SPIN_US = declare("POLYRUNNER_CPU_SPIN_US", int, 200,
                  "microseconds an idle pool helper spins before sleeping", ge=0, section=_S)
KERNELS = declare("POLYRUNNER_CPU_KERNELS", bool, True,
                  "build and use the C++ kernels; 0: reference attention, unfused modules, oneDNN linears",
                  section=_S)
SIMD = declare("POLYRUNNER_CPU_SIMD", bool, True,
               "0: use the portable kernel build (the plain loops an AVX2-only CPU runs)", section=_S)
PREFILL_KERNEL = declare("POLYRUNNER_CPU_PREFILL_KERNEL", bool, True,
                         "0: bfloat16 prefill attention by SDPA instead of the AVX512_BF16 kernel", section=_S)
PREFILL_ATTENTION = declare("POLYRUNNER_CPU_PREFILL_ATTENTION", str, "auto",
                            "bfloat16 prefill attention kernel; auto: the faster here (AMX tiles or AVX512_BF16), "
                            "timed once per machine and head shape", choices=("auto", "amx", "dpbf16"), section=_S)
DECODE_PREFETCH = declare("POLYRUNNER_CPU_DECODE_PREFETCH", str, "auto",
                          "where the bfloat16 decode attention prefetches the next KV block; auto: the faster "
                          "here (l1 or l2), timed once per machine and head shape", choices=("auto", "l1", "l2"),
                          section=_S)
LINEAR_PREFETCH = declare("POLYRUNNER_CPU_LINEAR_PREFETCH", str, "auto",
                          "where the pool's bfloat16 linears prefetch their weights; auto: the faster here "
                          "(l1 or l2), timed once per machine", choices=("auto", "l1", "l2"), section=_S)
AMX = declare("POLYRUNNER_CPU_AMX", bool, True,
              "0: no AMX linear kernel (a stand-in for CPUs without AMX)", section=_S)
DPBF16 = declare("POLYRUNNER_CPU_DPBF16", bool, True,
                 "0: no AVX512_BF16 linear kernel (a stand-in for CPUs without it)", section=_S)
AVX512 = declare("POLYRUNNER_CPU_AVX512", bool, True,
                 "0: no AVX-512F (float32 FMA) bfloat16 linear kernel (a stand-in for CPUs without AVX-512)",
                 section=_S)
LINEAR = declare("POLYRUNNER_CPU_LINEAR", str, "auto",
                 "bfloat16 linear kernel for every step; auto: the fastest per weight shape and row count, "
                 "timed at the first start on this machine and cached",
                 choices=("auto", "amx", "dpbf16", "avx512", "onednn"), section=_S)
PACK = declare("POLYRUNNER_CPU_PACK", bool, True,
               "0: keep bfloat16 linears unpacked (no oneDNN weight packing)", section=_S)
FUSE = declare("POLYRUNNER_CPU_FUSE", bool, True,
               "0: no fused RMSNorm, rotary and SiLU-multiply kernels (bfloat16 and float32)", section=_S)
MOE = declare("POLYRUNNER_CPU_MOE", bool, True,
              "0: mixture-of-experts layers by the core's reference (a loop over experts in torch) instead of "
              "one C++ call per layer", section=_S)
GRAPHS = declare("POLYRUNNER_CPU_GRAPHS", bool, True,
                 "0: no CPU graphs of decode steps (as enforce_eager, for the CPU backend only)", section=_S)
QUANT_ISA = declare("POLYRUNNER_CPU_QUANT_ISA", str, None,
                    "force the GGUF-quantized kernels' instruction-set path (an error if not built); "
                    "unset: the fastest this build has", choices=("scalar", "avx2", "avxvnni", "avx512vnni"),
                    section=_S)
