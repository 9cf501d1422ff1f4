"""The set-up every Triton test module runs first, before it imports a kernel module:
skip the module where triton is not installed, and without a GPU turn Triton's
interpreter on (TRITON_INTERPRET=1 must precede the kernels' definition)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def use_triton(interpret: bool = True) -> bool:
    """Skip the calling module without triton; without a GPU (and `interpret`) set
    TRITON_INTERPRET=1. Returns whether a GPU is there (the kernels then run compiled)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton, or the dev extra)", allow_module_level=True)
    has_cuda = torch.cuda.is_available()
    if not has_cuda and interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    return has_cuda
