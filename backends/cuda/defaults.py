"""The CUDA backend's default scheduler limits: vLLM's (`EngineArgs.get_batch_defaults`,
V1 engine, v0.11+), chosen by the device's memory and name.

| device                                  | usage             | max_num_batched_tokens | max_num_seqs |
|-----------------------------------------|-------------------|------------------------|--------------|
| >= 70 GiB, not an A100 (H100, H200, ...) | LLM_CLASS         | 16384                  | 1024         |
|                                         | OPENAI_API_SERVER | 8192                   | 1024         |
| otherwise (A100, smaller GPUs)          | LLM_CLASS         | 8192                   | 256          |
|                                         | OPENAI_API_SERVER | 2048                   | 256          |

The core applies them only to limits the user left unset (`polyrunner.default_limits`).
"""

from __future__ import annotations

import torch

from polyrunner.plugin_api import UsageContext

GiB = 1 << 30
LARGE_MEMORY = 70 * GiB   # vLLM's threshold; A100 80GB is excluded (larger budgets cost it throughput)

# (max_num_batched_tokens, max_num_seqs) per usage context
_LARGE: dict[UsageContext, tuple[int, int]] = {"LLM_CLASS": (16384, 1024), "OPENAI_API_SERVER": (8192, 1024)}
_OTHER: dict[UsageContext, tuple[int, int]] = {"LLM_CLASS": (8192, 256), "OPENAI_API_SERVER": (2048, 256)}


def batch_defaults(total_memory: int, device_name: str, usage: UsageContext) -> dict[str, int]:
    """vLLM's defaults for a device with `total_memory` bytes named `device_name`."""
    large = total_memory >= LARGE_MEMORY and "a100" not in device_name.lower()
    tokens, seqs = (_LARGE if large else _OTHER)[usage]
    return {"max_num_batched_tokens": tokens, "max_num_seqs": seqs}


def cuda_default_limits(usage: UsageContext) -> dict[str, int]:
    """`batch_defaults` of CUDA device 0 (call only where CUDA is available)."""
    props = torch.cuda.get_device_properties(0)
    return batch_defaults(int(props.total_memory), str(props.name), usage)
