"""Each engine's worker as a `rounds.Job`: the one place that says how polyrunner, llama.cpp and vLLM
are started (script, flags, environment), so that `compare.py`'s table on the embedded model and
`model_compare.py`'s tables on the realistic models run them alike.

Every worker runs the workloads once (`--repeats 1`: one round; `rounds.py` repeats the rounds) and
prints a `LOAD {json}` line and one `RESULT {json}` line per workload. `max_tokens` caps every
workload's output (smoke runs only).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rounds import Job

HERE = Path(__file__).resolve().parent


def worker_args(workloads: list[str], max_tokens: int | None) -> list[str]:
    """The arguments every worker script takes alike."""
    return ["--workload", *workloads, "--repeats", "1"] + (["--max-tokens", str(max_tokens)] if max_tokens else [])


def polyrunner_job(engine: str, file: str, model: str | None, workloads: list[str], max_tokens: int | None,
                   dtype: str | None = None, kv_cache_bytes: int | None = None, path: str | None = None) -> Job:
    """polyrunner (this venv) on `model` (a GGUF file, an HF folder, or None: the embedded model), quantized
    as `LLM()` runs a GGUF file by default unless `dtype`; `path`: the file it reads (default `model`)."""
    cmd = [sys.executable, str(HERE / "polyrunner_workload.py"), "--runner", engine]
    cmd += ["--model", model] if model else []
    cmd += ["--dtype", dtype] if dtype else []
    cmd += ["--kv-cache-bytes", str(kv_cache_bytes)] if kv_cache_bytes else []
    return Job(engine, file, cmd + worker_args(workloads, max_tokens), workloads, path=path or model or "")


def llama_cpp_job(python: Path, file: str, model: str, workloads: list[str], threads: int,
                  max_tokens: int | None) -> Job:
    """llama-cpp-python (its venv's `python`) on the GGUF file `model`, `threads` threads."""
    cmd = [str(python), str(HERE / "llama_cpp_workload.py"), "--model", model, "--threads", str(threads)]
    return Job("llama.cpp", file, cmd + worker_args(workloads, max_tokens), workloads, path=model)


def vllm_env(kv_cache_gib: int) -> dict[str, str]:
    """vLLM CPU's environment: OpenMP threads bound to every CPU this process may use, none reserved for
    the engine-core process (vLLM 0.32's "auto" would reserve one of two cores), the KV cache size."""
    n = len(os.sched_getaffinity(0))
    return dict(VLLM_CPU_OMP_THREADS_BIND=f"0-{n - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), TOKENIZERS_PARALLELISM="false")


def vllm_job(python: Path, mode: str, file: str, folder: str, dtype: str, workloads: list[str],
             max_tokens: int | None, kv_cache_gib: int = 4, max_num_batched_tokens: int | None = None) -> Job:
    """vLLM CPU (its venv's `python`) on the HF `folder`, `mode` "compiled" (vLLM's default CPU compile
    mode) or "eager" (`enforce_eager=True`); `max_num_batched_tokens` None: vLLM's default."""
    if mode not in ("compiled", "eager"):
        raise ValueError(f"vLLM mode {mode!r}: compiled or eager")
    cmd = [str(python), str(HERE / "vllm_workload.py"), "--model", folder, "--dtype", dtype]
    cmd += ["--eager"] if mode == "eager" else []
    cmd += ["--max-num-batched-tokens", str(max_num_batched_tokens)] if max_num_batched_tokens else []
    return Job(f"vllm-{mode}", file, cmd + worker_args(workloads, max_tokens), workloads, env=vllm_env(kv_cache_gib),
               path=folder)
