"""The host a benchmark ran on: CPU model, the instruction sets the CPU kernels
choose between, CPU counts. Read from /proc/cpuinfo (Linux); empty elsewhere."""

from __future__ import annotations

import os
from typing import Any

# the flags that pick a kernel path (AMX, AVX512_BF16 dot, VNNI int8, AVX2 fallback)
KERNEL_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx2")


def host_info(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    """`{"cpu": model name, "flags": the KERNEL_FLAGS present, "logical_cpus": n}`."""
    model, flags = "", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "flags": [f for f in KERNEL_FLAGS if f in flags], "logical_cpus": os.cpu_count()}


def format_host(info: dict[str, Any]) -> str:
    return f"host: {info['cpu'] or 'unknown CPU'}, {info['logical_cpus']} CPUs, flags {' '.join(info['flags']) or '-'}"
