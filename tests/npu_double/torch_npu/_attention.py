"""The attention ops of the torch_npu double: KV write, paged decode attention, the fused
inference attention (functional and `.out`) and their workspace getters. Each op binds its
documented signature, checks the documented rules (`_rules.py`) and computes the reference result
in float32. Callers' forms: vllm-ascend's vllm_ascend/attention/attention_v1.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from polyrunner.device.capture_guard import is_host_tensor
from torch_npu import _rules as R
from torch_npu._graph import LAST, emulating
from torch_npu._op import op

PA, FIA = "PA 基础功能/约束说明", "FIA 参数说明/约束说明"
INT_MAX = 2147483647
HOST = torch.device("cpu")   # the emulated device is the CPU: host data is what is declared so


def _gather(cache: torch.Tensor, table: torch.Tensor, blocks: int) -> torch.Tensor:
    """`[B, blocks * block_size, H, D]` from `[nb, bs, H, D]` through the table's first columns."""
    nb, bs, H, D = cache.shape
    return cache[table[:, :blocks].long()].reshape(table.shape[0], blocks * bs, H, D)


# ---- KV write ------------------------------------------------------------------------------
def _check_reshape_and_cache(c: dict[str, Any]) -> int:
    """RAC: key/value `[T, Hkv, D]`, caches `[num_blocks, block_size, Hkv, D]` ND (contiguous), one dtype,
    slotMapping int32 `[T]`."""
    key, value, kc, vc, slots = c["key"], c["value"], c["key_cache"], c["value_cache"], c["slot_indices"]
    R.half_dtypes("_npu_reshape_and_cache", "RAC", key=key, value=value, key_cache=kc, value_cache=vc)
    R.require(slots.dtype == torch.int32 and slots.shape == key.shape[:1],
              f"slot_indices must be int32 [T], got {slots.dtype} {tuple(slots.shape)}", "RAC slotMapping")
    R.require(kc.is_contiguous() and vc.is_contiguous(), "key_cache/value_cache must be contiguous (ND)", "RAC")
    R.require(key.shape[1:] == kc.shape[2:] and value.shape == key.shape,
              f"key {tuple(key.shape)} vs cache heads {tuple(kc.shape[2:])}", "RAC")
    return 0


@op(check=_check_reshape_and_cache, functional=False)
def _npu_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """ATB ReshapeAndCache: key/value written in place into the caches at the int32 slots."""
    H, D = key_cache.shape[2], key_cache.shape[3]
    slots = slot_indices.long()
    key_cache.view(-1, H, D)[slots] = key
    value_cache.view(-1, H, D)[slots] = value


# ---- paged decode attention (ATB PagedAttention) ---------------------------------------------------
def _check_paged_attention(c: dict[str, Any]) -> int:
    """PA 基础功能: query `[B, Hq, D]`, caches `[nb, bs, Hkv, D]`, blockTables int32 `[B, W]` on the device,
    contextLens int32 `[B]` on the HOST ("cpu or npu" column: cpu), attnOut `[B, Hq, D]`."""
    q, kc, vc, lens, out = c["query"], c["key_cache"], c["value_cache"], c["context_lens"], c["out"]
    R.half_dtypes("_npu_paged_attention", PA, query=q, key_cache=kc, value_cache=vc, out=out)
    B, Hq, D = q.shape
    R.require(kc.shape == vc.shape and kc.shape[3] == D, f"caches {tuple(kc.shape)} vs query {tuple(q.shape)}", PA)
    R.require(c["num_heads"] == Hq and kc.shape[2] == c["num_kv_heads"], "head counts do not match the tensors", PA)
    R.pa_heads(c["num_heads"], c["num_kv_heads"], D)
    R.pa_block_size(kc.shape[1])
    R.require(is_host_tensor(lens, HOST) and lens.dtype == torch.int32 and lens.shape == (B,),
              "context_lens must be an int32 [B] HOST tensor (declare it with polyrunner.plugin_api.host_tensor "
              "on the emulated device)", PA)
    kv = lens.tolist()
    R.require(min(kv) >= 1, f"context_lens must be >= 1, got {kv}", PA)
    R.block_table(c["block_table"], B, kv, kc.shape[1], PA)
    R.require(out.shape == q.shape, f"out {tuple(out.shape)} must be query's shape {tuple(q.shape)}", PA)
    needed = R.paged_workspace_bytes(B, Hq, D, max(kv))
    R.workspace("_npu_paged_attention", c.get("workspace"), needed)
    return needed


@op(check=_check_paged_attention, host=("context_lens",), functional=False)
def _npu_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int,
                         num_heads: int, scale_value: float, block_table: torch.Tensor, context_lens: torch.Tensor,
                         out: torch.Tensor, workspace: torch.Tensor | None = None) -> None:
    """ATB PagedAttention (decode), as vllm-ascend calls it (`_forward_decode_only`): writes `out`. Reads
    cdiv(max(context_lens), bs) blocks per row (`LAST[...]["blocks_read"]`), whatever the table's width."""
    B, Hq, D = query.shape
    lens = context_lens.long()
    blocks = -(-int(lens.max()) // key_cache.shape[1])
    LAST["_npu_paged_attention"]["blocks_read"] = blocks
    k = _gather(key_cache, block_table, blocks).float()       # [B, L, Hkv, D]
    v = _gather(value_cache, block_table, blocks).float()
    G = Hq // num_kv_heads
    q = query.float().view(B, num_kv_heads, G, D)
    scores = torch.einsum("bhgd,blhd->bhgl", q, k) * scale_value
    valid = torch.arange(k.shape[1])[None, :] < lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), v)
    out.copy_(o.reshape(B, Hq, D).to(out.dtype))


def _npu_paged_attention_get_workspace(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                       num_kv_heads: int, num_heads: int, scale_value: float,
                                       block_table: torch.Tensor, context_lens: torch.Tensor,
                                       out: torch.Tensor) -> torch.Tensor:
    """The workspace `_npu_paged_attention` needs for these context lengths (uint8); not a graph task."""
    call = dict(query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
                num_heads=num_heads, scale_value=scale_value, block_table=block_table, context_lens=context_lens,
                out=out)
    with emulating():
        return torch.empty(_check_paged_attention(call), dtype=torch.uint8)


# ---- fused inference attention ------------------------------------------------------------------
@dataclass(frozen=True)
class FiaShape:
    """A fused-attention call's batch: per batch its query rows and KV length."""

    batch: int
    q_s: int                 # the query's S: 1 is the decode (IncreFlashAttention) branch
    q_lens: list[int]
    kv_lens: list[int]
    heads: int
    kv_heads: int
    head_dim: int


def _fia_shape(c: dict[str, Any]) -> FiaShape:
    q, layout = c["query"], c["input_layout"]
    R.require(layout in ("TND", "BSND"), f"the double emulates input_layout TND and BSND, got {layout!r}",
              "torch_npu double")
    if layout == "TND":   # 参数说明 actual_seq_lengths: TND needs it, its length is B, cumulative ends
        T, N, D = q.shape
        ends = R.host_lengths("actual_seq_lengths", c["actual_seq_lengths"], len(c["actual_seq_lengths"] or []), FIA)
        R.require(bool(ends) and ends[-1] <= T and all(b >= a for a, b in zip([0] + ends, ends)),
                  f"actual_seq_lengths {ends}: non-decreasing cumulative ends within T={T}", FIA)
        q_lens = [b - a for a, b in zip([0] + ends, ends)]
        B, q_s = len(ends), max(q_lens)
    else:                 # BSND: one length per batch, at most S
        B, S, N, D = q.shape
        q_lens = R.host_lengths("actual_seq_lengths", c["actual_seq_lengths"], B, FIA)
        R.require(all(0 <= n <= S for n in q_lens), f"actual_seq_lengths {q_lens} exceed S={S}", FIA)
        q_s = S
    kv_lens = R.host_lengths("actual_seq_lengths_kv", c["actual_seq_lengths_kv"], B, FIA)
    R.require(all(n <= kv for n, kv in zip(q_lens, kv_lens)),
              "a batch's query is longer than its KV (the double emulates queries at the end of their context)",
              "torch_npu double")
    return FiaShape(B, q_s, q_lens, kv_lens, N, c["num_key_value_heads"] or c["num_heads"], D)


def _check_fia(c: dict[str, Any]) -> int:
    q, key, value = c["query"], c["key"], c["value"]
    R.half_dtypes("npu_fused_infer_attention_score", FIA, query=q, key=key, value=value)
    s = _fia_shape(c)
    R.require(s.heads == c["num_heads"], f"num_heads={c['num_heads']} vs the query's N={s.heads}", FIA)
    R.fia_heads(s.heads, s.kv_heads, s.head_dim, s.q_s)
    R.require(c["block_table"] is not None, "the double emulates paged KV only (block_table)", "torch_npu double")
    R.require(key.dim() == 3 and key.shape == value.shape and key.shape[2] == s.kv_heads * s.head_dim,
              f"paged key/value must be (blocknum, blocksize, H={s.kv_heads * s.head_dim}), got {tuple(key.shape)}",
              "FIA 约束说明 page attention场景")
    R.fia_block_size(c["block_size"], key.shape[1], s.q_s)
    R.block_table(c["block_table"], s.batch, s.kv_lens, key.shape[1], FIA)
    R.fia_layout_sparse(c["input_layout"], c["sparse_mode"], c["atten_mask"], s.q_s)
    if s.q_s == 1 and c["atten_mask"] is not None:
        R.decode_mask(c["atten_mask"], s.batch, c["block_table"].shape[1] * key.shape[1])
    R.require(not c["softmax_lse_flag"], "the double emulates softmax_lse_flag=False", "torch_npu double")
    needed = R.fused_workspace_bytes(s.batch, s.heads, s.head_dim, max(s.kv_lens))
    R.workspace("npu_fused_infer_attention_score", c.get("workspace"), needed)
    return needed


def _fia_compute(c: dict[str, Any]) -> torch.Tensor:
    """The attention output, laid out like the query; rows past a batch's length are 0.
    Q_S == 1: every KV position below the length, minus the mask's (sparse_mode, pre/next_tokens
    ignored); Q_S > 1: queries aligned to the end of their context, sparse_mode 0 (all), 3 (causal),
    4 (band: kv in [p - pre_tokens, p + next_tokens] for a query at position p)."""
    q, table, layout = c["query"], c["block_table"], c["input_layout"]
    s = _fia_shape(c)
    nb, bs, _ = c["key"].shape
    kc = c["key"].view(nb, bs, s.kv_heads, s.head_dim)
    vc = c["value"].view(nb, bs, s.kv_heads, s.head_dim)
    mask = None
    if s.q_s == 1 and c["atten_mask"] is not None:
        mask = R.decode_mask(c["atten_mask"], s.batch, table.shape[1] * bs)
    out = torch.zeros_like(q)
    rows = q if layout == "BSND" else None
    start = 0
    for b, (n, kv) in enumerate(zip(s.q_lens, s.kv_lens)):   # the double's loop over batches
        query = rows[b, :n] if rows is not None else q[start:start + n]
        if n and kv:
            blocks = -(-kv // bs)
            k = _gather(kc, table[b:b + 1], blocks)[0, :kv].float().repeat_interleave(s.heads // s.kv_heads, 1)
            v = _gather(vc, table[b:b + 1], blocks)[0, :kv].float().repeat_interleave(s.heads // s.kv_heads, 1)
            qpos = torch.arange(kv - n, kv)[:, None]
            kpos = torch.arange(kv)[None, :]
            allowed = torch.ones(n, kv, dtype=torch.bool)
            if mask is not None:
                allowed &= ~mask[b, :kv][None, :]
            elif s.q_s > 1 and c["sparse_mode"] in (3, 4):
                allowed &= kpos <= qpos + (c["next_tokens"] if c["sparse_mode"] == 4 else 0)
                if c["sparse_mode"] == 4:
                    allowed &= kpos >= qpos - c["pre_tokens"]
            scores = torch.einsum("qnd,knd->nqk", query.float(), k) * c["scale"]
            scores = scores.masked_fill(~allowed[None], float("-inf"))
            o = torch.einsum("nqk,knd->qnd", scores.softmax(-1), v).to(q.dtype)
            if rows is not None:
                out[b, :n] = o
            else:
                out[start:start + n] = o
        start += n
    return out


@op(check=_check_fia, host=("actual_seq_lengths", "actual_seq_lengths_kv"))
def npu_fused_infer_attention_score(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, pse_shift: torch.Tensor | None = None,
        atten_mask: torch.Tensor | None = None, actual_seq_lengths: list[int] | None = None,
        actual_seq_lengths_kv: list[int] | None = None, block_table: torch.Tensor | None = None,
        num_heads: int = 1, scale: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX,
        input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0, inner_precise: int = 0,
        block_size: int = 0, antiquant_mode: int = 0, softmax_lse_flag: bool = False
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu.npu_fused_infer_attention_score (函数原型; the subset the backend uses) -> (attention_out,
    softmax_lse); softmax_lse_flag False: softmax_lse is a [1] zero tensor (输出说明)."""
    return _fia_compute(dict(locals())), torch.zeros(1)


def _check_fia_out(c: dict[str, Any]) -> int:
    needed = _check_fia(c)
    out = c["out"]
    R.require(isinstance(out, (list, tuple)) and len(out) == 2 and out[0].shape == c["query"].shape
              and out[0].dtype == c["query"].dtype and out[1].numel() == 1,
              "out must be [attention_out like query, softmax_lse of one element]", "torch_npu .out")
    return needed


@op(check=_check_fia_out, host=("actual_seq_lengths", "actual_seq_lengths_kv"), functional=False,
    name="npu_fused_infer_attention_score.out")
def _fia_out(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, pse_shift: torch.Tensor | None = None,
             atten_mask: torch.Tensor | None = None, actual_seq_lengths: list[int] | None = None,
             actual_seq_lengths_kv: list[int] | None = None, block_table: torch.Tensor | None = None,
             num_heads: int = 1, scale: float = 1.0, pre_tokens: int = INT_MAX, next_tokens: int = INT_MAX,
             input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0,
             inner_precise: int = 0, block_size: int = 0, antiquant_mode: int = 0, softmax_lse_flag: bool = False,
             workspace: torch.Tensor | None = None, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """`npu_fused_infer_attention_score.out(..., workspace=None, out=[attention_out, softmax_lse])`: the op
    writing its results into `out` (what a graph task update re-binds), with an optional workspace."""
    out[0].copy_(_fia_compute(dict(locals())))
    out[1].zero_()
    return out


npu_fused_infer_attention_score.out = _fia_out   # type: ignore[attr-defined]


def _npu_fused_infer_attention_score_get_max_workspace(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The largest workspace the fused op needs for these shapes, whatever the lengths (uint8); takes the
    functional op's arguments; not a graph task. Sized for KV lengths up to the block table's width."""
    call = dict(_fia_defaults(), **kwargs, query=query, key=key, value=value)
    with emulating():
        _check_fia(call)
        s = _fia_shape(call)
        return torch.empty(R.fused_workspace_bytes(s.batch, s.heads, s.head_dim,
                                                   call["block_table"].shape[1] * key.shape[1]), dtype=torch.uint8)


def _fia_defaults() -> dict[str, Any]:
    return dict(pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
                block_table=None, num_heads=1, scale=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX,
                input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                antiquant_mode=0, softmax_lse_flag=False)
