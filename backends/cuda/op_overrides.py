"""The CUDA backend's op overrides (`Backend.op_overrides`), which the core applies: "rms_norm",
"rotary" and "gated_mlp" by the fused Triton modules (`fused_modules.py`), "moe" by the Triton
fused-MoE kernel (`moe_module.py`), "lora" (with LoRA enabled) by the Triton shrink and expand kernels
(`lora_module.py`), in float16, bfloat16 and float32. None ({}: the core's
modules run) when `POLYRUNNER_CUDA_FUSED=0`, `POLYRUNNER_CUDA_TRITON=0`, or triton is not
installed or fails to import. "linear" stays the core's (cuBLAS). Importing this module does not import triton.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch
from torch import nn

from polyrunner.backends.cuda import envs
from polyrunner.plugin_api import EngineConfig

logger = logging.getLogger(__name__)
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def cuda_op_overrides(config: EngineConfig, dtype: torch.dtype) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """The factories for a model in `dtype` (see the module docstring); `config.lora` says whether
    LoRA is enabled. Never raises."""
    if dtype not in FUSED_DTYPES or not (envs.TRITON.get() and envs.FUSED.get()):
        return {}
    if importlib.util.find_spec("triton") is None:
        return {}
    try:
        from polyrunner.backends.cuda.fused_modules import TritonGatedMLP, TritonRMSNorm, TritonRotary
        from polyrunner.backends.cuda.lora_module import lora_overrides
        from polyrunner.backends.cuda.moe_module import TritonFusedMoE
    except Exception as exc:  # noqa: BLE001 - a broken triton install keeps the core's modules
        logger.warning("cuda: triton failed to import (%s: %s): the core's RMSNorm, rotary, MLP and MoE modules run",
                       type(exc).__name__, exc)
        return {}
    return {"rms_norm": TritonRMSNorm, "rotary": TritonRotary, "gated_mlp": TritonGatedMLP, "moe": TritonFusedMoE,
            **lora_overrides(config)}
