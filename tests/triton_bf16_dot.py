"""A test-only fix of Triton's interpreter for bfloat16 `tl.dot`.

The interpreter stores bfloat16 tensors as their raw uint16 bits (numpy has no bfloat16) and its
`create_dot` hands those bits to `np.matmul` as integers, so a bfloat16 dot returns garbage
(tests/test_triton_attention.py skips bfloat16 without a GPU for this reason). `exact_bf16_dots`
widens bfloat16 operands to float32 exactly (the bits shifted into the high half) before the
interpreter's own dot, which is what the GPU's tensor cores compute (exact products, float32
accumulation). The kernels themselves run unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np


@contextmanager
def exact_bf16_dots() -> Iterator[None]:
    """Within the block, the interpreter's `tl.dot` takes bfloat16 operands as their float32 values."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    original = InterpreterBuilder.create_dot

    def widen(h: Any) -> Any:
        if h.dtype != tl.bfloat16:
            return h
        return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    InterpreterBuilder.create_dot = create_dot
    try:
        yield
    finally:
        InterpreterBuilder.create_dot = original
