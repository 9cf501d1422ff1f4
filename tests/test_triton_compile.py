"""The Triton kernels compile for an H100/H200 (sm_90) without a GPU, and none spills registers.

The interpreter (tests/test_triton_attention.py, tests/test_triton_fused_ops.py) checks the
numbers but not what only the compiler rejects (loop-carried types, dot shapes, constexpr
branches). `triton.compile` with an explicit `GPUTarget` runs the whole pipeline down to a
cubin with the ptxas that ships in the triton wheel, no device needed. The compiled kernel's
`n_regs`/`n_spills` are filled only when a GPU loads it, so the register use comes from running
that ptxas with `-v` on the kernel's PTX, as Triton does ("bytes spill stores"). It runs in a
subprocess because the test session turns the interpreter on (`tests/conftest.py`), which
replaces `@triton.jit`.

The attention kernel is compiled once per entry of its launch table (`attention_launch.TABLE`)
with that entry's constexprs, num_warps and num_stages, as Triton specialises a launch on the
backend's tensors: q, out and the caches have unit head-dim strides (an int argument equal to 1
becomes a constant), their other strides (multiples of the head size) and the pointers are
16-divisible. A launch on caches with a non-unit head-dim stride compiles another, slower variant
that this file does not check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton, or the dev extra)", allow_module_level=True)

ATTN_TYPES = {"q_ptr": "*{dt}", "kc_ptr": "*{dt}", "vc_ptr": "*{dt}", "out_ptr": "*{dt}", "part_acc_ptr": "*fp32",
              "part_ml_ptr": "*fp32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "tables_ptr": "*i32",
              "scale_log2": "fp32"}
# arguments a launch on the backend's tensors makes 16-divisible (pointers, strides that are multiples of D)
ATTN_DIVISIBLE = ("q_ptr", "kc_ptr", "vc_ptr", "out_ptr", "part_acc_ptr", "part_ml_ptr", "qsl_ptr", "seq_lens_ptr",
                  "tables_ptr", "q_st", "q_sh", "o_st", "o_sh", "kc_sb", "kc_ss", "kc_sh", "vc_sb", "vc_ss", "vc_sh")
# (dtype, step kind, GQA group, segments, window, num_reqs specialised to 1): split decode, sliding
# windows, fp32 IEEE dots, groups 1/3/8 (G=3 leaves rows over); each compiled at every head size with
# the launch table's entry for its head size, dtype and kind
CASES = [("bf16", "decode", 1, 16, 0, False), ("bf16", "decode", 8, 1, 7, True), ("bf16", "prefill", 1, 1, 0, False),
         ("bf16", "prefill", 3, 1, 4096, True), ("fp16", "decode", 3, 16, 7, False),
         ("fp16", "prefill", 8, 1, 7, False), ("fp32", "decode", 1, 16, 0, False),
         ("fp32", "decode", 3, 1, 4096, True), ("fp32", "prefill", 8, 1, 0, False), ("fp32", "prefill", 1, 1, 7, False)]
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SM90_SHARED = 232448   # bytes of shared memory one program may use on sm_90 (227 KiB)
HEAD_SIZES = (64, 128, 256)
NORM_WIDTHS = (128, 576, 4096, 8192, 16384)   # q/k norm, SmolLM2, Llama-8B, Llama-70B, the widest (MAX_BLOCK)
ROTARY_HEAD_SIZES = (64, 128, 256)
# every kernel variant compile_all builds, by name (the parametrisation of the no-spill test)
VARIANTS = ([f"attention {dt} {kind} G={g} segments={s} window={w} head={h}" for h in HEAD_SIZES
             for dt, kind, g, s, w, _ in CASES]
            + [f"combine head={h}" for h in HEAD_SIZES] + [f"kv_write head={h}" for h in HEAD_SIZES]
            + [f"rms_norm add={a} H={h}" for h in NORM_WIDTHS for a in (False, True)]
            + [f"rotary head={d}" for d in ROTARY_HEAD_SIZES] + ["silu_and_mul"])


def ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """{"regs", "spill_stores", "spill_loads", "stack"} of the one kernel in `ptx`, from the triton
    wheel's ptxas run with `-v` for `arch` as Triton runs it."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(src) + ".o"],
                              capture_output=True, text=True, check=True)
    log = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    return {"regs": int(regs.group(1)), "stack": int(spills.group(1)), "spill_stores": int(spills.group(2)),
            "spill_loads": int(spills.group(3))}


def compile_all(arch: int) -> dict[str, dict[str, int]]:
    """Compile every kernel variant of VARIANTS for `cuda:arch`: name -> ptxas usage and cubin size."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from polyrunner.backends.cuda import triton_activation as act
    from polyrunner.backends.cuda import triton_attention as ta
    from polyrunner.backends.cuda import triton_kv_write as kw
    from polyrunner.backends.cuda import triton_norm as tn
    from polyrunner.backends.cuda import triton_rotary as tr
    from polyrunner.backends.cuda.attention_launch import launch_params

    target = GPUTarget("cuda", arch, 32)
    done: dict[str, dict[str, int]] = {}

    def build(name: str, fn: Any, types: dict[str, str], consts: dict[str, Any], num_warps: int = 4,
              num_stages: int | None = None, divisible: tuple[str, ...] = ()) -> None:
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                        attrs=attrs)
        options = {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages})
        kernel = triton.compile(src, target=target, options=options)
        done[name] = {**ptxas_usage(kernel.asm["ptx"], arch), "cubin": len(kernel.asm["cubin"]),
                      "shared": kernel.metadata.shared, "num_warps": num_warps, "num_stages": num_stages or 0}

    for head in HEAD_SIZES:
        for dt, kind, group, segments, window, one_req in CASES:
            launch = launch_params(head, getattr(torch, TORCH_DTYPES[dt]), group, kind == "decode")
            consts = dict(NUM_HEADS=2 * group, G=group, HEAD_SIZE=head, HEAD_PAD=head, BLOCK_SIZE=16,
                          TILE=launch.tile, BLOCK_M=launch.block_m, BLOCK_Q=launch.block_q, WINDOW=window,
                          SEGMENTS=segments, IEEE=dt == "fp32", SOFTCAP=0.0, q_sd=1, o_sd=1, kc_sd=1, vc_sd=1)
            if one_req:
                consts["num_reqs"] = 1  # what Triton's specialisation of an argument equal to 1 gives
            name = f"attention {dt} {kind} G={group} segments={segments} window={window} head={head}"
            build(name, ta._attention_kernel, {k: v.format(dt=dt) for k, v in ATTN_TYPES.items()}, consts,
                  launch.num_warps, launch.num_stages, ATTN_DIVISIBLE)
            done[name] |= {"tile": launch.tile, "block_m": launch.block_m, "block_q": launch.block_q}
        build(f"combine head={head}", ta._combine_kernel, {"out_ptr": "*bf16", "part_acc_ptr": "*fp32",
                                                            "part_ml_ptr": "*fp32", "qsl_ptr": "*i32"},
              dict(NUM_HEADS=9, HEAD_SIZE=head, HEAD_PAD=head, SEGMENTS=16))
        build(f"kv_write head={head}", kw._kv_write_kernel, {"k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*bf16",
                                                             "vc_ptr": "*bf16", "slot_ptr": "*i64"},
              dict(NUM_KV_HEADS=3, HEADS_PAD=4, HEAD_SIZE=head, HEAD_PAD=head, BLOCK_SIZE=16))
    norm_types = {"x_ptr": "*bf16", "r_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16", "w_ptr": "*bf16",
                  "eps": "fp32"}
    for width in NORM_WIDTHS:
        rows, block, warps = tn.launch_shape(width, 1 << 16)   # many rows, as in a prefill
        for add in (False, True):
            build(f"rms_norm add={add} H={width}", tn._rms_norm_kernel, norm_types,
                  dict(ADD=add, ROWS=rows, BLOCK=block), warps)
    for head in ROTARY_HEAD_SIZES:
        heads, half = tr.launch_shape(32, 8, head)
        build(f"rotary head={head}", tr._rotary_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "cos_ptr": "*fp32",
                                                         "sin_ptr": "*fp32", "pos_ptr": "*i64"},
              dict(HEADS=heads, HALF=half))
    block, warps = act.launch_shape(14336)
    build("silu_and_mul", act._silu_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16"}, dict(BLOCK=block), warps)
    return done


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, int]]:
    """compile_all(90), run in a subprocess without the interpreter."""
    nvidia = Path(importlib.util.find_spec("triton").submodule_search_locations[0]) / "backends" / "nvidia"
    if not (nvidia / "bin" / "ptxas").exists():
        pytest.skip(f"this triton wheel ships no ptxas under {nvidia}/bin")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__, "90"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_sm90(compiled: dict[str, dict[str, int]]) -> None:
    assert sorted(compiled) == sorted(VARIANTS)
    assert all(report["cubin"] > 0 and report["regs"] > 0 for report in compiled.values()), compiled


@pytest.mark.parametrize("name", VARIANTS)
def test_no_register_spills(compiled: dict[str, dict[str, int]], name: str) -> None:
    report = compiled[name]
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, f"{name} spills registers: {report}"
    assert report["shared"] <= SM90_SHARED, f"{name} needs more shared memory than sm_90 has: {report}"


def test_every_attention_table_entry_is_compiled() -> None:
    """CASES cover each (head bucket, dtype class, step kind) of the launch table, in each 16-bit dtype."""
    from polyrunner.backends.cuda.attention_launch import TABLE

    covered = {(h, "float32" if dt == "fp32" else "half", kind) for h in HEAD_SIZES for dt, kind, *_ in CASES}
    assert covered == set(TABLE)
    assert {(dt, kind) for dt, kind, *_ in CASES} == {(dt, k) for dt in TORCH_DTYPES for k in ("decode", "prefill")}


if __name__ == "__main__":
    print(json.dumps(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
