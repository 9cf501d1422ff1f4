"""The persistent XLA compilation cache: compiled graphs kept on disk across engine starts.

`enable(on_tpu)` points torch_xla's cache (`torch_xla.runtime.initialize_cache`) at
`POLYRUNNER_XLA_CACHE_DIR` (default `<POLYRUNNER_CACHE>/xla-compile` on a TPU; none on the CPU
PJRT device, whose client in torch_xla 2.9 writes executables but cannot deserialize them, so
every lookup there fails and compiles anyway). It must run before this process compiles its
first graph; later, a process already compiling keeps what it has (logged).
`lookups()` reads torch_xla's counters of disk-cache hits, misses and failed loads, which the
executor records for its warm-up (`XLAGraphExecutor.warmup_cache`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from polyrunner.backends.xla import envs
from polyrunner.plugin_api import cache_root

logger = logging.getLogger(__name__)
COUNTERS = {"hits": "PersistentCacheHit", "misses": "PersistentCacheMiss",
            "load_failures": "PersistentCacheDeserializeFailure"}


def cache_dir(on_tpu: bool) -> Path | None:
    """The folder the cache should use, or None (see the module docstring)."""
    value = envs.CACHE_DIR.get()
    if value == "off":
        return None
    if value:
        return Path(value).expanduser()
    return cache_root() / "xla-compile" if on_tpu else None


def enable(on_tpu: bool) -> Path | None:
    """Turn the disk cache on for this process (idempotent); the folder in use, or None."""
    import torch_xla
    import torch_xla.runtime as xr
    path = cache_dir(on_tpu)
    if path is None:
        return None
    current = os.environ.get("XLA_PERSISTENT_CACHE_PATH")
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        if current != str(path):
            logger.warning("xla: this process compiled before the compilation cache could be set "
                           "(%s): %s is not used", current or "no disk cache", path)
            return Path(current) if current else None
        return path
    path.mkdir(parents=True, exist_ok=True)
    xr.initialize_cache(str(path), readonly=False)
    logger.info("xla: persistent compilation cache in %s", path)
    return path


def lookups() -> dict[str, int]:
    """torch_xla's disk-cache counters so far in this process."""
    import torch_xla.debug.metrics as met
    return {name: int(met.counter_value(counter) or 0) for name, counter in COUNTERS.items()}
