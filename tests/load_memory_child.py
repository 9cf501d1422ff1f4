"""Run by tests/test_load_memory.py in a fresh process: load a model with `LLM(...)` and print, as
JSON, the start-up time and the process's memory (bytes) relative to its baseline after `import
polyrunner` and a warm torch: `resident` after the load and after one generated token (which
touches every weight), `peak` (VmHWM, reset before the load: Linux `clear_refs` 5).

usage: python load_memory_child.py MODEL CACHE_DIR [DTYPE [MAX_NUM_BATCHED_TOKENS]]
CACHE_DIR holds the converted GGUF folders and the repacked-blocks cache (the compiled kernels
stay in the user's cache: building them again would take minutes)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def main() -> None:
    model, cache = sys.argv[1], Path(sys.argv[2])
    import torch

    import polyrunner
    from polyrunner import LLM, SamplingParams
    from polyrunner.backends.cpu import kernels, repack_cache
    from polyrunner.models.gguf import cache as gguf_cache

    gguf_cache.gguf_cache_root = lambda: cache / "gguf"
    repack_cache.cache_dir = lambda: cache / "cpu_repack"
    kernels.paged_attention_kernel()   # the compiled library: loaded (and built) before the baseline
    (torch.ones(64, 64) @ torch.ones(64, 64)).sum()
    assert polyrunner
    base = status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # VmHWM := VmRSS
    started = time.perf_counter()
    kwargs = dict(backend="cpu", kv_cache_memory_bytes=64 << 20, max_model_len=256, max_num_seqs=4)
    if len(sys.argv) > 3:
        kwargs["dtype"] = sys.argv[3]
    if len(sys.argv) > 4:
        kwargs["max_num_batched_tokens"] = int(sys.argv[4])
    llm = LLM(model, **kwargs)
    seconds = time.perf_counter() - started
    loaded = status()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2, temperature=0),
                 use_tqdm=False)
    ran = status()
    print(json.dumps({"startup_s": seconds, "resident_loaded": loaded["VmRSS"] - base["VmRSS"],
                      "resident": ran["VmRSS"] - base["VmRSS"], "file": ran["RssFile"] - base["RssFile"],
                      "peak": loaded["VmHWM"] - base["VmRSS"],
                      "quantization": llm.engine.quantization}))


if __name__ == "__main__":
    main()
