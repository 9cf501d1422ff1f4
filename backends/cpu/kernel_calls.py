"""The one way the CPU backend's Python calls its C++ kernels: `call(fn, *args)`.

A call runs the ctypes function `fn` now; while a CPU graph is being captured
(`record_calls()`, see `graphs.py`) it is instead appended to the capture's record
as `(kernel id, arguments)`, which `graph_replay.cpp` replays without Python.
`REPLAYABLE` lists the kernels the replayer knows, in its `Kernel` enum's order;
a call of any other function during a capture fails the capture.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from typing import Any, Iterator

# The kernels `pr_replay` can call; the index + 1 is the id in graph_replay.cpp's `Kernel` enum.
REPLAYABLE = ("pr_quant_linear", "pr_quant_linear8", "pr_dpbf16_linear_bf16", "pr_amx_linear_bf16",
              "pr_rms_norm", "pr_add_rms_norm", "pr_silu_mul", "pr_rotary",
              "pr_paged_attention", "pr_gather_rows", "pr_moe", "pr_avx512_linear_bf16", "pr_lora",
              "pr_lora_embed", "pr_quant_rows", "pr_moe_quant")
KERNEL_IDS = {name: i + 1 for i, name in enumerate(REPLAYABLE)}
MAX_ARGS = 26  # arguments a record holds (pr_paged_attention has 26)


class NotReplayable(RuntimeError):
    """A capture met something `pr_replay` cannot repeat."""


_state = threading.local()   # .record: the capture in progress on this thread


def call(fn: Any, *args: Any) -> Any:
    """`fn(*args)` (a ctypes function of the kernel library); while this thread
    captures, recorded instead (a capture computes nothing: the replay does)."""
    record = getattr(_state, "record", None)
    if record is None:
        return fn(*args)
    record.append(encode(fn.__name__, args))
    return 0


def encode(name: str, args: tuple) -> list[int]:
    """`[kernel id, arg0, ...]` as int64s: ints (pointers, sizes, flags) as they are,
    floats as their float64 bits (the replayer narrows them to the C `float`)."""
    if name not in KERNEL_IDS:
        raise NotReplayable(f"kernel {name} has no replay entry in graph_replay.cpp")
    if len(args) > MAX_ARGS:
        raise NotReplayable(f"kernel {name} takes {len(args)} arguments; a record holds {MAX_ARGS}")
    words = [KERNEL_IDS[name]]
    for a in args:
        words.append(struct.unpack("<q", struct.pack("<d", a))[0] if isinstance(a, float) else int(a))
    return words + [0] * (MAX_ARGS + 1 - len(words))


@contextlib.contextmanager
def record_calls() -> Iterator[list[list[int]]]:
    """Collect every `call` this thread makes inside the block, without running
    them (not re-entrant)."""
    if getattr(_state, "record", None) is not None:
        raise RuntimeError("a CPU graph capture is already in progress on this thread")
    _state.record = record = []
    try:
        yield record
    finally:
        _state.record = None
