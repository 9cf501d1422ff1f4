"""The weights of a converted GGUF folder, read from the GGUF file in place.

A converted folder (`loader.py`) holds no weight copy: `gguf_tensors.json`
records, for every tensor under its Hugging Face name, where its bytes lie in
the GGUF file (GGML type, shape, offset, byte count, and the llama.cpp rotary
row permutation to undo). `iter_weights` reads each tensor from the file (through a
mapping of that tensor's bytes alone, unmapped when the tensor goes) and
dequantizes it into the run dtype (`gguf.quants.dequantize` to float32, as
transformers does, then a cast; row chunks of at most `STAGING_BYTES` of float32
at a time), so nothing is written for a quantized run, whose remaining dense
tensors (norms, embeddings) are few.

A run that reads every tensor densely (an explicit dtype, or a backend without
quantized execution) of a file with block-quantized tensors would dequantize
the whole model at every start (SmolLM2-135M: seconds, a 7B file: minutes), so
the first such run keeps its tensors in `model.<dtype>.safetensors` in the
folder, in that dtype only, written while it loads; later runs in that dtype
read that file. A file of float tensors only (F32/F16/BF16) is always read in
place.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polyrunner.models.gguf import partial
from polyrunner.models.gguf.errors import GGUFError, gguf_import_error
from polyrunner.models.weight_reader import map_range, read_safetensors

__all__ = ["TENSORS_FILE", "FLOAT_TYPES", "is_gguf_folder", "read_index", "tensor_shapes", "dense_cache_file",
           "describe_source", "iter_weights", "dense_copy", "checked_source", "unpermute_rotary"]

logger = logging.getLogger(__name__)

TENSORS_FILE = "gguf_tensors.json"
FLOAT_TYPES = ("F32", "F16", "BF16")   # GGML types read with a cast, no block dequantization
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def is_gguf_folder(folder: str | Path) -> bool:
    """Whether `folder` is a converted GGUF folder whose weights live in the GGUF file."""
    return (Path(folder) / TENSORS_FILE).is_file()


def read_index(folder: str | Path) -> dict[str, Any]:
    """The folder's tensor index: `source` (the GGUF file), its `size` and `mtime_ns`
    at conversion, and `tensors` (Hugging Face name -> type, shape, offset, nbytes,
    permute_heads), in the file's order."""
    path = Path(folder) / TENSORS_FILE
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        index["tensors"], index["source"]   # the keys every reader needs (KeyError when one is missing)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GGUFError(f"{path}: unreadable tensor index ({type(exc).__name__}: {exc}); "
                        "convert the GGUF file again (pass the .gguf file as the model)") from None
    return index


def tensor_shapes(folder: str | Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor's shape and the GGUF file it is in, from the index (nothing is read)."""
    index = read_index(folder)
    src = Path(index["source"])
    return {name: (tuple(t["shape"]), src) for name, t in index["tensors"].items()}


def dense_cache_file(folder: str | Path, dtype: torch.dtype) -> Path:
    """Where a dense run in `dtype` keeps the dequantized weights: `model.<dtype>.safetensors`."""
    return Path(folder) / f"model.{_DTYPE_NAMES[dtype]}.safetensors"


def describe_source(folder: str | Path, dtype: torch.dtype, skip: frozenset[str] = frozenset()) -> str:
    """Where `iter_weights` with these arguments reads from, for a log line."""
    cache = dense_cache_file(folder, dtype)
    if not skip and cache.is_file():
        return str(cache)
    return f"the GGUF file {read_index(folder)['source']} (in place)"


def iter_weights(folder: str | Path, dtype: torch.dtype, skip: frozenset[str] = frozenset(),
                 keep: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors in `dtype`, except those named in `skip` (never read).

    Reads `model.<dtype>.safetensors` when a dense run wrote it, else the GGUF
    file in place; a full read (`skip` empty) of a file with block-quantized
    tensors writes `model.<dtype>.safetensors` as it goes (see the module doc)
    unless `keep` is False."""
    folder = Path(folder)
    index = read_index(folder)
    cache = dense_cache_file(folder, dtype)
    if not skip and cache.is_file():
        yield from _read_cache(cache)
        return
    quantized = any(t["type"] not in FLOAT_TYPES for t in index["tensors"].values())
    if skip or not quantized or not keep:
        yield from _read_gguf(index, dtype, skip)
        return
    yield from _read_gguf_and_cache(folder, index, dtype, cache)


def dense_copy(folder: str | Path, dtype: torch.dtype) -> Path:
    """`model.<dtype>.safetensors` of the folder, written now if missing: for programs
    that read the folder as a plain Hugging Face checkpoint (another runner, a
    benchmark against one; they glob `*.safetensors`, so keep one dtype there)."""
    folder = Path(folder)
    cache = dense_cache_file(folder, dtype)
    if not cache.is_file():
        for _ in _read_gguf_and_cache(folder, read_index(folder), dtype, cache):
            pass
        if not cache.is_file():
            raise OSError(f"cannot write {cache} (see the warning above)")
    return cache


# ------------------------------------------------------------------ reading


def _read_gguf(index: dict[str, Any], dtype: torch.dtype,
               skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the GGUF file in `dtype`, read through a mapping of its own bytes only
    (`weight_reader.map_range`: the file's pages leave the process with the tensor) and
    dequantized in row chunks of at most `STAGING_BYTES` of float32, so neither the whole
    file nor a whole tensor is staged in float32."""
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError as exc:
        raise gguf_import_error(exc) from None
    src = checked_source(index)
    fd = os.open(src, os.O_RDONLY)
    try:
        for name, t in index["tensors"].items():
            if name not in skip:
                yield name, _dense_tensor(fd, src, name, t, dtype, GGMLQuantizationType, dequantize)
    finally:
        os.close(fd)


STAGING_BYTES = 64 << 20   # float32 bytes dequantized at a time (per tensor: a row chunk)


def _dense_tensor(fd: int, src: Path, name: str, t: dict[str, Any], dtype: torch.dtype, qtypes: Any,
                  dequantize: Any) -> torch.Tensor:
    """Tensor `name` of the index (`t`) read from the open GGUF file `fd`, in `dtype`, its
    rotary rows un-permuted."""
    shape = tuple(t["shape"])
    mapped = map_range(fd, t["offset"], t["nbytes"])   # unmapped when the last view of it goes
    if t["type"] in FLOAT_TYPES:   # a cast, no dequantization
        w = mapped.view(_FLOAT_VIEWS[t["type"]]).view(shape).to(dtype)
    else:
        raw, rows = mapped.numpy(), shape[0] if len(shape) > 1 else 1
        w = torch.empty(shape, dtype=dtype)
        flat, blocks = w.view(rows, -1), raw.reshape(rows, -1)
        step = max(1, STAGING_BYTES // max(1, 4 * flat.shape[1]))
        try:
            for r in range(0, rows, step):
                if t["type"] == "Q8_0":
                    flat[r:r + step] = _dequantize_q8_0(blocks[r:r + step])
                else:
                    flat[r:r + step] = torch.from_numpy(np.asarray(dequantize(blocks[r:r + step], qtypes[t["type"]]),
                                                                   dtype=np.float32))
        except Exception as exc:
            raise GGUFError(f"{src}: cannot dequantize tensor {t.get('name', name)!r} ({t['type']}): "
                            f"{type(exc).__name__}: {exc}") from None
    if t.get("permute_heads"):
        heads = t["permute_heads"]
        w = w.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
    return w if w.dtype == dtype else w.to(dtype)


_FLOAT_VIEWS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _dequantize_q8_0(raw: np.ndarray) -> torch.Tensor:
    """GGML Q8_0 blocks (a float16 scale, then 32 int8 weights), rows of `raw`, as float32: the
    same values as gguf's numpy `dequantize`, in a few threaded torch ops (~3x faster)."""
    blocks = torch.from_numpy(raw).view(-1, 34)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    return blocks[:, 2:].view(torch.int8).float().mul_(scale).view(raw.shape[0], -1)


def _read_cache(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from polyrunner.models.hf_config import ModelFileError

    try:
        yield from read_safetensors(path)
    except ModelFileError as exc:
        raise ModelFileError(f"{exc}; the dense weight cache {path} is corrupt: delete it to have it written again",
                             path) from None


def checked_source(index: dict[str, Any]) -> Path:
    """The index's GGUF file; GGUFError if it is gone or changed (size, mtime) since the conversion."""
    src = Path(index["source"])
    try:
        st = src.stat()
    except OSError:
        raise GGUFError(f"the GGUF file {src} this folder's weights are read from is gone; "
                        "pass the .gguf file itself as the model") from None
    if st.st_size != index.get("size", st.st_size) or st.st_mtime_ns != index.get("mtime_ns", st.st_mtime_ns):
        raise GGUFError(f"the GGUF file {src} changed since this folder was converted from it; "
                        "pass the .gguf file itself as the model (it is converted again)")
    return src


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head, n_head_kv)` on q/k rows (weights and biases)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------ the dense cache


def _read_gguf_and_cache(folder: Path, index: dict[str, Any], dtype: torch.dtype,
                         cache: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the GGUF file in place and write `cache` as the tensors go by: into a
    `.partial` folder (`partial.py`: a killed run's is reclaimed) renamed into
    place when complete. A folder that cannot be written is only read."""
    try:
        partial.reclaim_abandoned(folder.glob(".*.partial"))
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", suffix=".partial", dir=folder))
        partial.claim(tmp)
    except OSError as exc:
        logger.warning("cannot keep dequantized %s weights in %s (%s); reading the GGUF file in place",
                       _DTYPE_NAMES[dtype], folder, exc)
        yield from _read_gguf(index, dtype)
        return
    started = time.perf_counter()
    nbytes = _header_and_size(index, dtype)[1]
    logger.info("dequantizing %d tensors into %s (%.0f MB) for %s runs of this model", len(index["tensors"]),
                cache, nbytes / 1e6, _DTYPE_NAMES[dtype])
    try:
        with open(tmp / cache.name, "wb") as f:
            header, _ = _header_and_size(index, dtype)
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for name, w in _read_gguf(index, dtype):
                f.write(memoryview(w.contiguous().view(torch.uint8).numpy()))
                yield name, w
            f.flush()
            os.fsync(f.fileno())   # the renamed file must not outlive its data
        partial.release(tmp)
        os.replace(tmp / cache.name, cache)
        logger.info("wrote %s in %.1f s", cache.name, time.perf_counter() - started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _header_and_size(index: dict[str, Any], dtype: torch.dtype) -> tuple[bytes, int]:
    """The safetensors header for every tensor of the index in `dtype` (8-byte aligned) and the data size."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "gguf"}}
    offset = 0
    for name, t in index["tensors"].items():
        n = itemsize * math.prod(t["shape"])
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(t["shape"]),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8), offset
