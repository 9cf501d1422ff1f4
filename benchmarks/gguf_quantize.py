"""llama.cpp's own converter and quantizer, for benchmarks/realistic_models.py: `convert_hf_to_gguf.py` and
its gguf-py from the llama-cpp-python sdist that compare.py builds (so the converter, its gguf-py and the
quantizer are one llama.cpp version), and `llama_model_quantize` through llama-cpp-python's ctypes binding
in the llama.cpp venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"      # llama-cpp-python: its sdist's converter, its build's quantizer
# llama.cpp's enum llama_ftype (llama.h; LLAMA_FTYPE_MOSTLY_*)
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7}


def llama_cpp_tools(root: Path) -> Path:
    """vendor/llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/ from the llama-cpp-python sdist
    of LLAMA_CPP_VERSION (pip download, once), extracted under `root`/_tools/."""
    dest = root / "_tools" / f"llama.cpp-{LLAMA_CPP_VERSION}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        print(f"[models] downloading the llama-cpp-python {LLAMA_CPP_VERSION} sdist for its converter", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
                if rel and (rel in wanted or rel.startswith(wanted[1:])) and (m.isfile() or m.isdir()):
                    m.name = rel
                    members.append(m)
            tar.extractall(partial, members=members, filter="data")
        partial.rename(dest)
    return dest


def convert_to_gguf(tools: Path, hf: Path, out: Path) -> Path:
    """`convert_hf_to_gguf.py hf --outtype bf16` from `tools` (`llama_cpp_tools`; this venv: torch,
    transformers; the vendored gguf-py)."""
    if out.is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    start = time.perf_counter()
    cmd = [sys.executable, str(tools / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16", "--outfile", str(tmp),
           "--model-name", f"{hf.parent.name} (random weights)"]
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    tmp.rename(out)
    print(f"[models] {out.name}: converted ({out.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - start:.0f} s)",
          flush=True)
    return out


QUANTIZE_CHILD = r"""
import ctypes, sys
import llama_cpp as L
inp, out, ftype, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
L.llama_backend_init()
p = L.llama_model_quantize_default_params()
p.ftype, p.nthread = ftype, threads
rc = L.llama_model_quantize(inp.encode(), out.encode(), ctypes.byref(p))
sys.exit(rc)
"""


def quantize(llama_python: Path, src: Path, out: Path, qtype: str, threads: int) -> Path:
    """`llama_model_quantize(src, out, ftype=qtype)` in the llama.cpp venv."""
    if out.is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    start = time.perf_counter()
    proc = subprocess.run([str(llama_python), "-c", QUANTIZE_CHILD, str(src), str(tmp), str(FTYPES[qtype]),
                           str(threads)], capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        raise RuntimeError(f"llama_model_quantize {qtype} failed (rc {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-4000:]}")
    tmp.rename(out)
    print(f"[models] {out.name}: quantized ({out.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - start:.0f} s)",
          flush=True)
    return out
