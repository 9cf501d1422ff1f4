"""The quantized linears' blocks in the layout the kernels run, kept in a file that later starts map.

A GGUF file's matrices mostly run in the r8 layout (`quant_linear.repack8`), and a fused linear
(`qkv_proj`, `gate_up_proj`) stacks the rows of its checkpoint parts: either way a copy in
another layout, which used to be made in memory at every start (seconds for a 1.7B model) and
held next to the GGUF bytes it came from. Here the first start writes those blocks, a few matrices
at a time (`THREADS`), into one file under `cache_root()/cpu_repack/`, and every start maps that file read-only:
the blocks are file-backed pages of the page cache (one resident copy, nothing repacked, nothing
anonymous), populated when mapped so that the first step takes no page faults on them. Matrices
that run as the GGUF file stores them (one part, rows in order, not r8) need no entry: their
blocks are a view of the GGUF file itself (`QuantizedWeight.blocks`).

The file's name is a key of what decides its bytes: `FORMAT_VERSION`, the kernel library's build
(whose sources define the r8 layouts), the instruction-set path that decides which matrices take
r8, and every entry's GGUF source (file path, size, mtime; offsets, type, shape). The file is
written beside its place and renamed into it (a reader never sees a partial one); it ends with a
checksum of each entry's first and last `SAMPLE` bytes (`_sums`: a cheap check, not of every
byte). A file whose header disagrees with its name, whose size is not the header's, or whose
sampled bytes do not match their checksums is rebuilt with a log line; entries of the same GGUF
path under other keys (a changed file, an older version), and the folders of GGUF files that are
gone, are deleted when a new one is written. When the file cannot be written
(a full disk, a read-only cache) the blocks are repacked in memory, as before, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from polyrunner.plugin_api import cache_root

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2   # 2: the checksums after the data
MAGIC = b"PRBLOCK1"
SUMS_MAGIC = b"PRSUMS01"   # after the data: then one crc32 (4 bytes, little-endian) per entry
SAMPLE = 4096   # bytes at each end of an entry that its checksum covers
ALIGN = 4096   # every entry starts on a page: its view is page-aligned (and 64-byte aligned for the kernels)
THREADS = min(4, os.cpu_count() or 1)   # matrices repacked at once on the first start
Repack = Callable[[Any, torch.Tensor, torch.Tensor], object]
SOURCE_FILE = "source"   # in each GGUF file's folder: the file's path (a folder whose file is gone is deleted)


@dataclass(frozen=True)
class Entry:
    """One matrix as the kernels run it: `nbytes` at `offset` of the data, in `layout` ("r8" or "gguf")."""

    key: str
    layout: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def cache_dir() -> Path:
    """`cache_root()/cpu_repack` (`POLYRUNNER_CACHE`, else the XDG or home cache)."""
    return cache_root() / "cpu_repack"


class PreparedBlocks:
    """Each cached matrix's blocks (by `QuantizedWeight.key`) as a uint8 view of the mapped file,
    in its layout; `path` is the file (None when the blocks were not cached: `get` then finds none)."""

    def __init__(self, views: dict[str, tuple[str, torch.Tensor]], path: Path | None) -> None:
        self._views, self.path = views, path

    def get(self, key: str | None) -> tuple[str, torch.Tensor] | None:
        """`(layout, blocks)` of the matrix `key`, None when it has no cache entry."""
        return None if key is None else self._views.get(key)

    def __len__(self) -> int:
        return len(self._views)


def prepare(weights: Sequence[Any], layout: Callable[[Any], str | None], r8_bytes: Callable[[Any], int],
            repack: Repack, tag: str) -> PreparedBlocks:
    """The cached blocks of the `weights` (`QuantizedWeight`s) that need a layout of their own:
    `layout(w)` is "r8", "gguf" or None (not run quantized); a "gguf" one read in place needs no
    entry. `r8_bytes(w)`: the r8 size; `repack(w, gguf_blocks, out)` writes its r8 blocks into `out`
    (uint8, `r8_bytes(w)`); `tag`: what
    decides which matrices take r8 (the library build and instruction-set path). Maps the cache
    file, writing it first when missing or unusable (see the module docstring)."""
    todo: dict[str, tuple[Any, str]] = {}
    for w in weights:
        kind = layout(w) if w is not None and w.key is not None else None
        if kind is not None and (kind == "r8" or not w.in_place):
            todo.setdefault(w.key, (w, kind))
    if not todo:
        return PreparedBlocks({}, None)
    entries, size = _plan(todo, r8_bytes)
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, tag, [(e.key, e.layout) for e in entries]]).encode()
                         ).hexdigest()[:20]
    first = next(iter(todo.values()))[0].source
    folder = cache_dir() / f"{_safe_name(Path(first.path).stem)}-{hashlib.sha256(first.path.encode()).hexdigest()[:12]}"
    path = folder / f"{key}.blocks"
    if path.is_file():
        why = _check(path, key, entries, size)
        if why is None:
            return _mapped(path, entries, size)
        logger.warning("the repacked-blocks cache %s is unusable (%s): writing it again", path, why)
    try:
        _write(path, key, entries, size, todo, repack)
    except OSError as exc:
        logger.warning("cannot write the repacked-blocks cache %s (%s): repacking %d matrices in memory at every "
                       "start instead", path, exc, len(todo))
        return PreparedBlocks({}, None)
    for old in folder.glob("*.blocks"):   # other keys of this GGUF path: a changed file, an older layout
        if old != path:
            old.unlink(missing_ok=True)
    (folder / SOURCE_FILE).write_text(first.path)
    reclaim_orphans()
    return _mapped(path, entries, size)


def reclaim_orphans() -> list[Path]:
    """Delete the cache folders whose GGUF file is gone (its path is in each folder's `SOURCE_FILE`);
    returns them. Folders without that record are left alone."""
    gone = []
    for folder in cache_dir().glob("*/"):
        try:
            source = (folder / SOURCE_FILE).read_text()
        except OSError:
            continue
        if not Path(source).exists():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def _plan(todo: dict[str, tuple[Any, str]], r8_bytes: Callable[[Any], int]) -> tuple[list[Entry], int]:
    entries, offset = [], 0
    for key, (w, kind) in todo.items():
        nbytes = r8_bytes(w) if kind == "r8" else w.nbytes
        shape = (w.shape[0] // 8, nbytes // (w.shape[0] // 8)) if kind == "r8" else (w.shape[0], w.row_bytes)
        entries.append(Entry(key, kind, shape, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def _header(key: str, entries: list[Entry], size: int) -> bytes:
    body = json.dumps({"version": FORMAT_VERSION, "key": key, "data_bytes": size,
                       "entries": [[e.key, e.layout, list(e.shape), e.offset, e.nbytes] for e in entries]}).encode()
    head = MAGIC + len(body).to_bytes(8, "little") + body
    return head + b"\0" * (-len(head) % ALIGN)


def _sums_bytes(entries: list[Entry]) -> int:
    return len(SUMS_MAGIC) + 4 * len(entries)


def _sums(data: Any, entries: list[Entry]) -> bytes:
    """The checksums that end the file: `SUMS_MAGIC`, then per entry the crc32 of its first and last
    `SAMPLE` bytes (`data`: the data section, anything sliceable to bytes-like)."""
    out = bytearray(SUMS_MAGIC)
    for e in entries:
        n = min(SAMPLE, e.nbytes)
        sample = bytes(data[e.offset:e.offset + n]) + bytes(data[e.offset + e.nbytes - n:e.offset + e.nbytes])
        out += zlib.crc32(sample).to_bytes(4, "little")
    return bytes(out)


def _check(path: Path, key: str, entries: list[Entry], size: int) -> str | None:
    """None when `path` holds this key's entries, all their bytes and matching checksums
    (`_sums`), else what is wrong."""
    want = _header(key, entries, size)
    try:
        with open(path, "rb") as f:
            head = f.read(len(want))
            actual = os.fstat(f.fileno()).st_size
            stored = computed = b""
            if head == want and actual == len(want) + size + _sums_bytes(entries):
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    data = memoryview(mm)[len(want):len(want) + size]
                    stored, computed = bytes(mm[len(want) + size:]), _sums(data, entries)
                    data.release()
    except OSError as exc:
        return f"unreadable: {exc}"
    if head[:len(MAGIC)] != MAGIC:
        return "not a blocks file"
    if head != want:
        return "its header does not match the GGUF file and kernels it is for"
    if actual != len(want) + size + _sums_bytes(entries):
        return f"{actual} bytes, {len(want) + size + _sums_bytes(entries)} expected (truncated?)"
    if stored != computed:
        return "its blocks do not match their checksums (corrupt)"
    return None


def _write(path: Path, key: str, entries: list[Entry], size: int, todo: dict[str, tuple[Any, str]],
           repack: Repack) -> None:
    """Write the file beside `path`, the matrices straight into a shared mapping of it by `THREADS`
    threads (each holds one matrix's GGUF blocks at a time), then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    head = _header(key, entries, size)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    logger.info("repacking %d quantized matrices into %s (%.0f MB), once for this model and machine", len(entries),
                path, size / 1e6)
    try:
        with open(tmp, "w+b") as f:
            f.write(head)
            total = len(head) + size + _sums_bytes(entries)
            _allocate(f.fileno(), total)   # a full disk fails here, not with SIGBUS later
            with mmap.mmap(f.fileno(), total) as mm:
                data = torch.frombuffer(mm, dtype=torch.uint8)[len(head):len(head) + size]
                with ThreadPoolExecutor(THREADS) as pool:
                    list(pool.map(_fill, entries, [todo[e.key][0] for e in entries], [data] * len(entries),
                                  [repack] * len(entries)))
                del data   # the map closes only once no tensor views it
                view = memoryview(mm)
                view[len(head) + size:] = _sums(view[len(head):len(head) + size], entries)
                view.release()
                mm.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("repacked into %s in %.1f s", path.name, time.perf_counter() - started)


def _allocate(fd: int, nbytes: int) -> None:
    """Reserve the file's disk space (Linux: OSError ENOSPC now, where writing through the map would
    raise SIGBUS); elsewhere only set its size."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        fallocate(fd, 0, nbytes)
    else:
        os.ftruncate(fd, nbytes)


def _fill(e: Entry, w: Any, data: torch.Tensor, repack: Repack) -> None:
    """Write matrix `w` (entry `e`) into its place in `data`, reading its GGUF blocks only now."""
    blocks = torch.from_numpy(w.blocks)
    out = data[e.offset:e.offset + e.nbytes]
    if e.layout == "r8":
        repack(w, blocks, out)
    elif blocks.numel() != e.nbytes:
        raise RuntimeError(f"{e.key}: {blocks.numel()} bytes, {e.nbytes} expected")
    else:
        out.copy_(blocks.reshape(-1))


def _mapped(path: Path, entries: list[Entry], size: int) -> PreparedBlocks:
    """The entries as views of one read-only shared mapping of `path` (the `size` bytes before the
    checksums are the data), populated up front (the kernels only read them)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
    with warnings.catch_warnings():   # read-only memory: nothing writes the blocks
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = whole.numel() - _sums_bytes(entries) - size
    views = {e.key: (e.layout, whole[start + e.offset:start + e.offset + e.nbytes].view(e.shape)) for e in entries}
    return PreparedBlocks(views, path)


def _safe_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:80] or "model"
