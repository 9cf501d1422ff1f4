"""What the real attention ops refuse, as their documentation states it: one function per rule,
each citing its source. A broken rule raises `DocError` naming the argument, the rule and the
value given.

Sources:
- FIA: the op-plugin documentation of torch_npu.npu_fused_infer_attention_score
  (gitee/github Ascend/op-plugin, docs/context/torch_npu-npu_fused_infer_attention_score.md;
  the same text as the Ascend Extension for PyTorch API reference), sections 参数说明
  (parameters) and 约束说明 (constraints: "TND、TND_NTD、NTD_TND场景下..." for TND, "当Q_S大于1时"
  and "当Q_S等于1时" for prefill and decode, "page attention场景" for paged KV).
- PA: CANN ATB PagedAttentionOperation, which `_npu_paged_attention` runs (hiascend.com
  canncommercial 9.0.0 API/ascendtb/ascendtb_01_0198.html 约束说明, ascendtb_01_0202.html 基础功能).
- RAC: CANN ATB ReshapeAndCacheOperation, which `_npu_reshape_and_cache` runs (ascendtb_01_0073).
- Workspaces: `_npu_paged_attention_get_workspace` sizes for the context lengths it is given
  (vllm-ascend passes its largest, SEQ_LEN_WITH_MAX_PA_WORKSPACE, at capture: "only returns max
  workspace with specific seq_lens", vllm_ascend/worker/model_runner_v1.py);
  `_npu_fused_infer_attention_score_get_max_workspace` sizes for the largest lengths the shapes
  allow (the graph_task_update_end.md example updates a longer length with it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HALF = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048   # the compressed [2048, 2048] mask of sparse modes 2, 3, 4


class DocError(RuntimeError):
    """An argument the real op refuses."""


def require(cond: bool, message: str, doc: str) -> None:
    if not cond:
        raise DocError(f"torch_npu double: {message} [{doc}]")


# ---- dtypes --------------------------------------------------------------------------------
def half_dtypes(op: str, doc: str, **tensors: torch.Tensor) -> None:
    """FIA 参数说明 query/key/value: float16, bfloat16 (int8 quantized, not emulated);
    PA 基础功能 query/keyCache/valueCache: float16/bf16; RAC key/value/caches: float16/bf16/int8, all one
    dtype ("数据类型都必须完全一致")."""
    for name, t in tensors.items():
        require(t.dtype in HALF, f"{op}: {name} must be float16 or bfloat16, got {t.dtype}", doc)
    dtypes = {t.dtype for t in tensors.values()}
    require(len(dtypes) == 1, f"{op}: {', '.join(tensors)} must share one dtype, got {sorted(map(str, dtypes))}", doc)


# ---- block sizes -----------------------------------------------------------------------------
def fia_block_size(block_size: int, key_block: int, q_s: int) -> None:
    """FIA 约束说明, page attention场景: Q_S > 1: "block_size最小为128，最大为512，且要求是128的倍数";
    Q_S == 1: a multiple of 16 for float16/bfloat16 KV. block_size is the cache's block dimension."""
    doc = "FIA 约束说明 page attention场景"
    require(block_size == key_block, f"block_size={block_size} differs from the KV cache's block dimension "
                                     f"{key_block}", doc)
    if q_s > 1:
        require(128 <= block_size <= 512 and block_size % 128 == 0,
                f"block_size={block_size} with Q_S > 1: page attention takes 128 to 512 in steps of 128", doc)
    else:
        require(block_size % 16 == 0, f"block_size={block_size} with Q_S == 1: page attention takes multiples "
                                      "of 16 for float16/bfloat16 KV", doc)


def pa_block_size(block_size: int) -> None:
    """PA 约束说明: "block_size %16 == 0，推荐 block_size = 128"."""
    require(block_size % 16 == 0, f"_npu_paged_attention: block_size={block_size} must be a multiple of 16",
            "PA 约束说明")


# ---- heads -----------------------------------------------------------------------------------
def fia_heads(num_heads: int, num_kv_heads: int, head_dim: int, q_s: int) -> None:
    """FIA 约束说明: N <= 256, D <= 512 (Q_S > 1 and Q_S == 1), D 16-aligned for float16/bfloat16
    inputs ("输入类型全为float16、bfloat16时，D轴需16对齐"); 参数说明 num_key_value_heads: num_heads a
    multiple of it, the ratio at most 64."""
    doc = "FIA 约束说明 / 参数说明 num_key_value_heads"
    require(0 < num_heads <= 256, f"num_heads={num_heads}: N must be in (0, 256]", doc)
    require(0 < head_dim <= 512 and head_dim % 16 == 0,
            f"head dim {head_dim}: D must be a multiple of 16 up to 512 for float16/bfloat16", doc)
    require(num_kv_heads > 0 and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64,
            f"num_heads={num_heads}, num_key_value_heads={num_kv_heads}: num_heads must be a multiple, at most "
            "64 times", doc)


def pa_heads(num_heads: int, num_kv_heads: int, head_size: int) -> None:
    """PA 约束说明: "head_size范围为(0, 256]"; GQA: "headNum > kvHeadNum且headNum%kvHeadNum == 0"."""
    doc = "PA 约束说明"
    require(0 < head_size <= 256, f"_npu_paged_attention: head_size={head_size} must be in (0, 256]", doc)
    require(num_kv_heads > 0 and num_heads % num_kv_heads == 0,
            f"_npu_paged_attention: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}", doc)


# ---- layouts and sparse modes -------------------------------------------------------------------
def fia_layout_sparse(layout: str, sparse_mode: int, atten_mask: torch.Tensor | None, q_s: int) -> None:
    """FIA 约束说明:
    - TND: "sparse模式仅支持sparse=0且不传mask，或sparse=3且传入mask";
    - Q_S > 1: sparse_mode 0..4; "sparse_mode=2、3、4时，atten_mask的shape需要为(S, S)...S的值需要固定为2048";
    - Q_S == 1 (and no rope inputs): sparse_mode, pre_tokens and next_tokens are ignored ("Q_S为1且不带rope
      输入时该参数无效"); a mask, if any, is (B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S).
    The double emulates TND and BSND, and no full user mask with Q_S > 1 (sparse_mode 0 without one).
    Not enforced: the same TND section's sub-rules "when query's d != 512" (Q_D = K_D = 192, no page
    attention, bfloat16 only), which vllm-ascend contradicts (attention_v1.py runs TND with paged KV,
    head size 128, float16 and bfloat16 on CANN 8.3)."""
    doc = "FIA 约束说明"
    require(layout in ("TND", "BSND"), f"the double emulates input_layout TND and BSND, got {layout!r}",
            "torch_npu double")
    if layout == "TND":
        require((sparse_mode == 0 and atten_mask is None) or (sparse_mode == 3 and atten_mask is not None),
                f"input_layout TND takes sparse_mode 0 without atten_mask or 3 with it, got sparse_mode="
                f"{sparse_mode} {'with' if atten_mask is not None else 'without'} atten_mask", doc)
    if q_s > 1:
        require(sparse_mode in (0, 2, 3, 4) and (sparse_mode != 0 or atten_mask is None),
                f"sparse_mode={sparse_mode} with Q_S > 1: the double emulates 0 (no mask), 3 and 4", "torch_npu double")
        if sparse_mode in (2, 3, 4):
            require(atten_mask is not None and atten_mask.dtype in (torch.bool, torch.int8, torch.uint8)
                    and tuple(atten_mask.shape[-2:]) == (MASK_SIZE, MASK_SIZE),
                    f"sparse_mode={sparse_mode} needs the compressed {MASK_SIZE}x{MASK_SIZE} atten_mask", doc)


def decode_mask(atten_mask: torch.Tensor, batch: int, kv_s: int) -> torch.Tensor:
    """The Q_S == 1 mask as (B, KV_S) bool (1 = masked); FIA 参数说明 atten_mask: "Q_S为1时建议shape输入
    (B, KV_S)、(B, 1, KV_S)、(B, 1, 1, KV_S)"; page attention: KV_S >= maxBlockNumPerSeq * blockSize."""
    doc = "FIA 参数说明 atten_mask / 约束说明 page attention场景"
    require(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), f"atten_mask dtype {atten_mask.dtype}", doc)
    mask = atten_mask.reshape(atten_mask.shape[0], -1)
    require(mask.shape[0] == batch and mask.shape[1] >= kv_s,
            f"atten_mask {tuple(atten_mask.shape)} with Q_S == 1 must be (B={batch}, KV_S >= {kv_s})", doc)
    return mask[:, :kv_s].bool()


# ---- paged KV -------------------------------------------------------------------------------
def block_table(table: torch.Tensor | None, batch: int, kv_lens: Sequence[int], block_size: int, doc: str) -> None:
    """FIA 约束说明 page attention场景: "blockTable必须为二维，第一维长度需等于B，第二维长度不能小于
    maxBlockNumPerSeq"; PA 约束说明: "max_num_blocks_per_seq >= (max(contextLens) + block_size - 1) //
    block_size"; int32 (FIA 参数说明 block_table, PA 基础功能 blockTables)."""
    require(table is not None and table.dtype == torch.int32 and table.dim() == 2,
            "block_table must be a 2-D int32 tensor", doc)
    assert table is not None
    need = -(-max(kv_lens, default=0) // block_size)
    require(table.shape[0] == batch and table.shape[1] >= need,
            f"block_table {tuple(table.shape)}: {batch} rows of at least {need} blocks", doc)


def host_lengths(name: str, value: object, batch: int, doc: str) -> list[int]:
    """FIA 参数说明 actual_seq_lengths(_kv): host int arrays (SymInt[]), one per batch; page attention
    needs actual_seq_lengths_kv ("page attention场景下，必须传入actual_seq_lengths_kv")."""
    require(isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value),
            f"{name} must be a host list of ints, got {type(value).__name__}", doc)
    assert isinstance(value, (list, tuple))
    require(len(value) == batch, f"{name} has {len(value)} entries for {batch} batches", doc)
    return list(value)


# ---- workspaces ---------------------------------------------------------------------------------
def paged_workspace_bytes(batch: int, num_heads: int, head_size: int, max_len: int) -> int:
    """The double's `_npu_paged_attention` workspace: per (request, head), a partial row of float32
    (head_size + max + sum) per 128 tokens of context. Grows with the longest context."""
    return batch * num_heads * -(-max(max_len, 1) // 128) * (head_size + 2) * 4


def fused_workspace_bytes(batch: int, num_heads: int, head_dim: int, max_kv: int) -> int:
    """The double's fused-attention workspace, the same shape of formula."""
    return batch * num_heads * -(-max(max_kv, 1) // 128) * (head_dim + 2) * 4


def workspace(op: str, given: torch.Tensor | None, needed: int) -> None:
    """An explicit workspace must hold what the op needs for this call's lengths (the update docs pass
    one sized at capture: graph_task_update_end.md; vllm-ascend sizes it for the largest context)."""
    if given is not None:
        require(given.numel() * given.element_size() >= needed,
                f"{op}: workspace of {given.numel() * given.element_size()} bytes, these lengths need {needed} "
                "(size it for the largest context)", "torch_npu graph_task_update_end.md example")
