"""What torch_npu's attention ops take, checked once when an engine is configured, so that a
configuration they refuse fails at start-up with the field, the rule and the value given (vLLM's
wording), not deep inside a kernel launch.

- dtype: float16 or bfloat16 (npu_fused_infer_attention_score's query, ATB PagedAttention's query
  and caches; no float32). Checked by `NPUBackend.check_dtype` before the model loads.
- block_size: 128 to 512 in steps of 128 (npu_fused_infer_attention_score with paged KV and more
  than one query token, which every prefill step runs; ATB PagedAttention takes multiples of 16).
  Checked by `NPUBackend.adjust_config`.
- head size: a multiple of 16 (the fused op with float16/bfloat16) up to 256 (ATB PagedAttention).
  Checked with the KV cache's spec, the first place the backend sees the model's head size.

Sources: the op-plugin documentation of torch_npu.npu_fused_infer_attention_score (约束说明: "page
attention场景 ... block_size最小为128，最大为512，且要求是128的倍数", "D轴需16对齐"), CANN's ATB
PagedAttentionOperation constraints (ascendtb_01_0198: "head_size范围为(0, 256]").
"""

from __future__ import annotations

import torch

from polyrunner.plugin_api import KVCacheSpec

DTYPES = (torch.bfloat16, torch.float16)
BLOCK_SIZES = (128, 256, 384, 512)
HEAD_SIZE_MULTIPLE, MAX_HEAD_SIZE = 16, 256


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_dtype(dtype: torch.dtype, allowed: tuple[torch.dtype, ...] = DTYPES) -> None:
    """ValueError unless torch_npu's attention ops take `dtype`."""
    if dtype not in allowed:
        raise ValueError(f"dtype={_name(dtype)} is not supported by backend 'npu': torch_npu's attention ops "
                         f"(npu_fused_infer_attention_score, _npu_paged_attention) take float16 and bfloat16 "
                         f"only; allowed: {', '.join(map(_name, allowed))}")


def check_block_size(block_size: int) -> None:
    """ValueError unless the paged-attention ops take `block_size` tokens per block."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not supported by backend 'npu': torch_npu's paged "
                         "attention (npu_fused_infer_attention_score with a block_table) takes block sizes from "
                         f"128 to 512 in steps of 128; allowed: {', '.join(map(str, BLOCK_SIZES))}")


def check_head_size(head_size: int) -> None:
    """ValueError unless the attention ops take heads of `head_size`."""
    if head_size % HEAD_SIZE_MULTIPLE or not 0 < head_size <= MAX_HEAD_SIZE:
        allowed = ", ".join(map(str, range(HEAD_SIZE_MULTIPLE, MAX_HEAD_SIZE + 1, HEAD_SIZE_MULTIPLE)))
        raise ValueError(f"head_size={head_size} is not supported by backend 'npu': torch_npu's attention ops "
                         f"take multiples of {HEAD_SIZE_MULTIPLE} up to {MAX_HEAD_SIZE} "
                         f"(npu_fused_infer_attention_score: 16-aligned; _npu_paged_attention: at most 256); "
                         f"allowed: {allowed}")


def check_kv_spec(spec: KVCacheSpec) -> None:
    """The KV cache's dtype, block size and head size (each check above)."""
    check_dtype(spec.dtype)
    check_block_size(spec.block_size)
    check_head_size(spec.head_size)
