"""The machine's streaming-read bandwidth, and the bytes of weights a decode step reads, for the
"bandwidth used" figure of `compare.py --model`:

    bandwidth used = bytes of weights read per token x tok/s / streaming-read bandwidth

- Streaming-read bandwidth: `torch.sum` over a float32 buffer of 1 GiB (32x this project's 32 MiB L3),
  touched once before, with the threads the engines get; the median of several passes.
- Bytes of weights read per token (one decode step of one sequence reads every weight once): the
  tensors of the file, less the token embedding (a decode step reads one row of it), plus the LM head,
  which is the embedding itself when the model ties them. For a GGUF file: the tensors' bytes as stored
  (quantized blocks, F32 norms). For a safetensors folder: the bytes as stored (bf16: 2 per parameter).
"""

from __future__ import annotations

import json
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

GGUF_EMBEDDING, GGUF_HEAD = "token_embd.weight", "output.weight"
HF_EMBEDDING, HF_HEAD = "model.embed_tokens.weight", "lm_head.weight"
SAFETENSORS_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "BOOL": 1}


def read_bandwidth(threads: int, nbytes: int = 1 << 30, passes: int = 7) -> dict[str, Any]:
    """Streaming-read bandwidth in bytes/s (median of `passes` sums over an `nbytes` buffer)."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        buf.sum()                      # first touch and warm-up
        rates = []
        for _ in range(passes):
            t0 = time.perf_counter()
            buf.sum()
            rates.append(buf.numel() * 4 / (time.perf_counter() - t0))
        del buf
    finally:
        torch.set_num_threads(old)
    return {"bytes_per_s": statistics.median(rates), "passes": rates, "threads": threads, "buffer_bytes": nbytes,
            "method": "torch.sum over a float32 buffer"}


def gguf_tensor_bytes(path: str | Path, gguf_py: Path | None = None) -> dict[str, int]:
    """{tensor name: bytes stored} of a GGUF file (llama.cpp's gguf-py, from realistic_models' tools)."""
    if gguf_py is not None and str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    import gguf
    reader = gguf.GGUFReader(str(path))
    return {t.name: int(t.n_bytes) for t in reader.tensors}


def safetensors_tensor_bytes(folder: str | Path) -> dict[str, int]:
    """{tensor name: bytes stored} of a safetensors folder, from the shards' headers."""
    out: dict[str, int] = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                out[name] = end - start
    return out


def weight_bytes_per_token(tensors: dict[str, int], embedding: str, head: str) -> int:
    """Bytes one decode step reads: every tensor but the embedding, plus the head (the embedding if tied)."""
    total = sum(b for name, b in tensors.items() if name != embedding)
    if head not in tensors:        # tied: the LM head reads the whole embedding matrix
        total += tensors.get(embedding, 0)
    return total


def file_weight_bytes(path: str | Path, gguf_py: Path | None = None) -> dict[str, int]:
    """{"file_bytes": on disk, "tensor_bytes": all tensors, "read_per_token": weight_bytes_per_token}."""
    path = Path(path)
    if path.is_dir():
        tensors = safetensors_tensor_bytes(path)
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        read = weight_bytes_per_token(tensors, HF_EMBEDDING, HF_HEAD)
    else:
        tensors = gguf_tensor_bytes(path, gguf_py)
        size = path.stat().st_size
        read = weight_bytes_per_token(tensors, GGUF_EMBEDDING, GGUF_HEAD)
    return {"file_bytes": size, "tensor_bytes": sum(tensors.values()), "read_per_token": read}


def bandwidth_used(read_per_token: int, tok_per_s: float, bytes_per_s: float) -> float:
    """The fraction of the streaming-read bandwidth a decode at `tok_per_s` uses for its weights."""
    return read_per_token * tok_per_s / bytes_per_s


if __name__ == "__main__":
    import os
    n = len(os.sched_getaffinity(0))
    for th in sorted({1, n}):
        r = read_bandwidth(th)
        print(f"{th} thread(s): {r['bytes_per_s'] / 1e9:.1f} GB/s (passes "
              f"{', '.join(f'{x / 1e9:.1f}' for x in r['passes'])})")
    for arg in sys.argv[1:]:
        print(arg, file_weight_bytes(arg))
