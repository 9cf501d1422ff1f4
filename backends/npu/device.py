"""The torch device the npu backend runs on, and the one seam a torch_npu test double uses.

`npu_device(index)` is `torch.device("npu", index)` with torch_npu. A test double of torch_npu
(tests/npu_double, never shipped) emulates the device on the host by setting the module
attribute `emulated_device_type = "cpu"`; the backend then puts its tensors on the CPU and
moves data with plain copies (`is_emulated`: pinned host memory needs a real accelerator).
Real torch_npu has no such attribute. Nothing else in the backend knows about the double.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import torch

NPU = "npu"


def device_type() -> str:
    """"npu", or the emulated device type a torch_npu double declares."""
    return str(getattr(sys.modules.get("torch_npu"), "emulated_device_type", NPU))


def npu_device(index: int) -> torch.device:
    """NPU `index` as a torch device."""
    return torch.device(device_type(), index)


def is_emulated(device: torch.device) -> bool:
    """The device is a test double's host emulation, not an NPU."""
    return device.type != NPU


def npu_module() -> Any:
    """`torch.npu`, which importing torch_npu registers."""
    mod: ModuleType = torch
    return mod.npu
