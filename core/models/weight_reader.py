"""Reading checkpoint tensors into host memory with one resident copy of the weights.

`safe_open(...).get_tensor` maps the whole shard: every page it reads stays in the
process's resident set (file-backed) until the shard is closed, next to the
parameters being filled, so a load peaked near twice the weights. Here each tensor
views a mapping of its own bytes only (`map_range`), which is unmapped when the caller
drops the tensor after copying it into its parameter: the peak is the parameters plus
about one tensor. (Reading into fresh buffers instead, with `pread`, halves the peak
too, but every buffer page is then a fresh page to fault in: 2.5x slower on a VM.)
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from polyrunner.models.hf_config import ModelFileError

__all__ = ["SAFETENSORS_DTYPES", "map_range", "safetensors_header", "read_safetensors"]

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}   # safetensors' dtype names (those torch >= 2.9 has)
MAX_HEADER = 100 << 20       # safetensors' own limit on the JSON header


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors file's header (tensor name -> dtype, shape, data_offsets; no
    `__metadata__`) and where its data begins. ModelFileError (naming the file) for a header
    that is not one, a dtype not read here, or offsets outside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n < 2 or n > min(MAX_HEADER, size - 8):
            raise ModelFileError(f"{path}: corrupt or truncated safetensors file (invalid header length {n})", path)
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ModelFileError(f"{path}: corrupt or truncated safetensors file (header: {exc})", path) from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: corrupt or truncated safetensors file (header is not an object)", path)
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, t in header.items():
        try:
            begin, end = t["data_offsets"]
            dtype = SAFETENSORS_DTYPES[t["dtype"]]
            want = math.prod(t["shape"]) * torch.empty((), dtype=dtype).element_size()
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFileError(f"{path}: corrupt or unsupported safetensors entry {name!r} "
                                 f"({type(exc).__name__}: {exc})", path) from None
        if not 0 <= begin <= end <= data_size or end - begin != want:
            raise ModelFileError(f"{path}: corrupt or truncated safetensors file (tensor {name!r} at bytes "
                                 f"{begin}..{end} of {data_size}, {want} expected)", path)
    return header, 8 + n


def map_range(fd: int, offset: int, nbytes: int) -> torch.Tensor:
    """The file's bytes `offset .. offset + nbytes` as a uint8 host tensor viewing a private
    mapping of just that range (copy-on-write: writing to it never reaches the file). The
    mapping lives exactly as long as the tensor (and its views); its pages are the page
    cache's, so no fresh memory is touched to read them."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    start = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, offset + nbytes - start, offset=start, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset - start)


def read_safetensors(path: Path, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors except those in `skip`, in file order, in the file's dtype and shape:
    each views a mapping of its own bytes only (`map_range`), which goes when the caller drops
    the tensor, so the file's pages in the process never exceed the tensors the caller holds."""
    header, data = safetensors_header(path)
    order = sorted((t["data_offsets"][0], name) for name, t in header.items() if name not in skip)
    fd = os.open(path, os.O_RDONLY)
    try:
        for begin, name in order:
            t = header[name]
            raw = map_range(fd, data + begin, t["data_offsets"][1] - begin)
            yield name, raw.view(SAFETENSORS_DTYPES[t["dtype"]]).view(tuple(t["shape"]))
            del raw
    finally:
        os.close(fd)
