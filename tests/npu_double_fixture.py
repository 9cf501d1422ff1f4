"""The `npu_double` fixture: the torch_npu test double (tests/npu_double) imported for one test,
then removed (sys.modules, `torch.npu`, transformers' cached availability, a memory meter left
running), so other tests see no torch_npu and the next gets a fresh double. Build Hugging Face
models before it (transformers would take the double for torch_npu)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

DOUBLE_PATH = str(Path(__file__).parent / "npu_double")


def _forget() -> None:
    memory = sys.modules.get("torch_npu._memory")
    if memory is not None:
        memory.MEMORY.stop()   # a peak meter a failed profile left metering
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[name]
    if hasattr(torch, "npu"):
        delattr(torch, "npu")
    utils = sys.modules.get("transformers.utils.import_utils")   # caches "torch_npu is available"
    if utils is not None:
        utils.is_torch_npu_available.cache_clear()


@pytest.fixture
def npu_double(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The imported double (`CALLS`, `REPLAYS`, `LAST`), with zeroed counters."""
    monkeypatch.syspath_prepend(DOUBLE_PATH)
    _forget()
    import torch_npu
    torch_npu.reset_counters()
    try:
        yield torch_npu
    finally:
        _forget()
