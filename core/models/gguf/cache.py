"""The cache of converted GGUF files: one folder per file (path, size, mtime, conversion
version), written atomically, reused by later runs, older versions' entries reclaimed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from polyrunner import envs
from polyrunner.models.gguf import partial
from polyrunner.models.gguf.loader import convert_gguf, write_json

__all__ = ["CONVERSION_VERSION", "MARKER_FILE", "cached_gguf_folder", "gguf_cache_root", "reclaim_older_versions"]

logger = logging.getLogger(__name__)

# Bump when the output of a conversion changes, so old cache entries are not reused
# (4: no float32 model.safetensors; weights read from the GGUF file, `tensors.py`).
CONVERSION_VERSION = 4
MARKER_FILE = "polyrunner_gguf.json"


def gguf_cache_root() -> Path:
    """`envs.cache_root()/gguf`: `$POLYRUNNER_CACHE/gguf`, else `$XDG_CACHE_HOME/polyrunner/gguf`,
    else `~/.cache/polyrunner/gguf`."""
    return envs.cache_root() / "gguf"


def cached_gguf_folder(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted folder for a GGUF file, converting it on first use.

    The cache entry is keyed by the file's absolute path, size and mtime (and
    the conversion version), so an edited or replaced file is converted again.
    A conversion is written into a temporary folder, completed with a marker
    file, then renamed into place: a half-written entry is never used; the
    temporary folder of a killed conversion is deleted by the next conversion
    once its owner process is gone (`partial.py`). A hit
    costs a few `stat` calls and imports nothing.
    """
    src = Path(path).expanduser().resolve()
    try:
        st = src.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"GGUF file not found: {src}") from None
    root = Path(cache_dir).expanduser() if cache_dir is not None else gguf_cache_root()
    key = hashlib.sha256(f"{CONVERSION_VERSION}\0{src}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = root / f"{_safe_name(src.stem)}-{key}"
    if (folder / MARKER_FILE).is_file():
        return folder

    root.mkdir(parents=True, exist_ok=True)
    partial.reclaim_abandoned(root.glob(".*.partial"))  # left by killed conversions (see partial.py)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=root))
    logger.info("converting %s (%.0f MB) -> %s (config and tokenizer; the weights stay in the file)",
                src, st.st_size / 1e6, folder)
    try:
        partial.claim(tmp)
        started = time.perf_counter()
        convert_gguf(src, tmp)
        marker = {
            "source": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "conversion_version": CONVERSION_VERSION,
            "seconds": round(time.perf_counter() - started, 3),
        }
        write_json(tmp / MARKER_FILE, marker)
        partial.release(tmp)
        if folder.exists() and not (folder / MARKER_FILE).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # leftover without a marker: never complete
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / MARKER_FILE).is_file():  # not a concurrent winner: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; use its entry
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", src.name, marker["seconds"])
    reclaimed = reclaim_older_versions(root, src)
    if reclaimed:
        logger.info("deleted %d cache entr%s of %s written by older polyrunner versions (%.0f MB)",
                    len(reclaimed), "y" if len(reclaimed) == 1 else "ies", src.name,
                    sum(size for _, size in reclaimed) / 1e6)
    return folder


def reclaim_older_versions(root: Path, src: Path) -> list[tuple[Path, int]]:
    """Delete the cache entries of the GGUF file `src` that an older CONVERSION_VERSION
    wrote (before version 4: a float32 copy of the weights, ~5x the file); returns
    each deleted folder with the bytes it held. Entries of other files, and of newer
    versions, are left alone."""
    gone = []
    for entry in root.glob(f"{_safe_name(src.stem)}-*"):
        try:
            marker = json.loads((entry / MARKER_FILE).read_text())
        except (OSError, ValueError):
            continue   # no marker: not a finished entry (or not ours); never delete it here
        version = marker.get("conversion_version") if isinstance(marker, dict) else None
        if marker.get("source") == str(src) and isinstance(version, int) and version < CONVERSION_VERSION:
            size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
            shutil.rmtree(entry, ignore_errors=True)
            gone.append((entry, size))
    return gone


def _safe_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:80] or "model"
