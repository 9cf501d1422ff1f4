"""The Triton kernels compile for an H100/H200 (sm_90) without a GPU.

The interpreter (tests/test_triton_attention.py) checks the numbers but not
what only the compiler rejects (loop-carried types, dot shapes, constexpr
branches). `triton.compile` with an explicit `GPUTarget` runs the whole
pipeline down to a cubin with the ptxas that ships in the triton wheel, no
device needed. It runs in a subprocess because the test session turns the
interpreter on (`tests/conftest.py`), which replaces `@triton.jit`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton, or the dev extra)", allow_module_level=True)

ATTN_TYPES = {"q_ptr": "*{dt}", "kc_ptr": "*{dt}", "vc_ptr": "*{dt}", "out_ptr": "*{dt}", "part_acc_ptr": "*fp32",
              "part_ml_ptr": "*fp32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "tables_ptr": "*i32",
              "scale_log2": "fp32"}
# (dtype, segments, window, num_reqs specialised to 1): decode split, sliding window, fp32 IEEE dots
CASES = [("bf16", 1, 0, False), ("bf16", 16, 7, False), ("fp16", 1, 4096, True), ("fp32", 16, 0, False)]


def compile_all(arch: int) -> list[str]:
    """Compile every kernel variant in CASES for `cuda:arch`; returns one line per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from polyrunner.backends.cuda import triton_attention as ta
    from polyrunner.backends.cuda import triton_kv_write as kw

    target = GPUTarget("cuda", arch, 32)

    def build(fn, types, consts):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        return triton.compile(src, target=target)

    done = []
    for dt, segments, window, one_req in CASES:
        consts = dict(NUM_HEADS=9, G=3, HEAD_SIZE=64, HEAD_PAD=64, BLOCK_SIZE=16, TILE=ta.TILE_SIZE, BLOCK_M=16,
                      BLOCK_Q=5, WINDOW=window, SEGMENTS=segments, IEEE=dt == "fp32")
        if one_req:
            consts["num_reqs"] = 1  # what Triton's specialisation of an argument equal to 1 gives
        kernel = build(ta._attention_kernel, {k: v.format(dt=dt) for k, v in ATTN_TYPES.items()}, consts)
        done.append(f"attention {dt} segments={segments} window={window}: {len(kernel.asm['cubin'])} bytes")
    build(ta._combine_kernel, {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                               "qsl_ptr": "*i32"}, dict(NUM_HEADS=9, HEAD_SIZE=64, HEAD_PAD=64, SEGMENTS=16))
    build(kw._kv_write_kernel, {"k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
                                "slot_ptr": "*i64"},
          dict(NUM_KV_HEADS=3, HEADS_PAD=4, HEAD_SIZE=64, HEAD_PAD=64, BLOCK_SIZE=16))
    return done + ["combine", "kv_write"]


def test_kernels_compile_for_sm90():
    nvidia = Path(importlib.util.find_spec("triton").submodule_search_locations[0]) / "backends" / "nvidia"
    if not (nvidia / "bin" / "ptxas").exists():
        pytest.skip(f"this triton wheel ships no ptxas under {nvidia}/bin")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "90"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("bytes") == len(CASES) and "kv_write" in proc.stdout


if __name__ == "__main__":
    print("\n".join(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
