"""A faithful test double of torch_npu (Ascend Extension for PyTorch), for CI without an NPU.

Never shipped: tests put `tests/npu_double` on sys.path (the `npu_double` fixture in
tests/npu_double_fixture.py, `PYTHONPATH=tests/npu_double` in .ci/npu.sh). Importing it
does what importing torch_npu does for the backend: `torch.npu` appears (module `npu.py`).

The emulated device: tensors "on the NPU" are CPU tensors. The one seam is
`emulated_device_type = "cpu"`, which the backend reads through
`polyrunner.backends.npu.device.npu_device` (real torch_npu has no such attribute: "npu").

Each op keeps its documented signature (arguments are bound to it, so a misspelt name or a
missing argument fails as on the device), checks the documented dtypes/layouts, computes the
reference result in torch, counts its calls in `CALLS` and keeps its last call's arguments in
`LAST`. Docs: the Ascend Extension for PyTorch API reference ("torch_npu.npu_*" pages,
hiascend.com/document/detail/zh/Pytorch/.../apiref/apilist/ptaoplist_*.html) and, for the
private `_npu_*` ops, their callers in vllm-ascend (vllm_ascend/attention/attention_v1.py).
Unlike the device, every float dtype is accepted (tests run float32).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from torch_npu import _graph
from torch_npu._graph import CALLS, LAST, REPLAYS

__version__ = torch.__version__.split("+")[0] + "+double"   # torch_npu X.Y.Z pairs with torch X.Y.Z
emulated_device_type = "cpu"
FIA_MASK_SIZE = 2048   # sparse_mode 2/3/4 take a [2048, 2048] bool mask (1 = masked), per the docs


def _op(host: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Bind a call to the op's documented signature, count it, run it (graph-aware, `_graph.run_op`).
    `host`: the arguments the op reads on the host (frozen into a captured graph)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def op(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            call = dict(bound.arguments)
            if _graph.STATE.updating is None:
                CALLS[fn.__name__] += 1
                LAST[fn.__name__] = call
            return _graph.run_op(fn, call, host)
        return op
    return wrap


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(f"torch_npu double: {message}")


# ---- KV cache and paged attention --------------------------------------------------------
@_op()
def _npu_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """ATB ReshapeAndCache, as vllm-ascend calls it (attention_v1.py: `torch_npu._npu_reshape_and_cache(
    key=, value=, key_cache=, value_cache=, slot_indices=)`): key/value `[T, Hkv, D]` written in place
    into key_cache/value_cache `[num_blocks, block_size, Hkv, D]` (ND, contiguous) at the int32 slots."""
    _check(slot_indices.dtype == torch.int32, f"slot_indices must be int32, got {slot_indices.dtype}")
    _check(key_cache.is_contiguous() and value_cache.is_contiguous(), "caches must be contiguous (ND)")
    _check(key.dtype == key_cache.dtype, "key and key_cache dtypes differ")
    H, D = key_cache.shape[2], key_cache.shape[3]
    _check(key.shape[1:] == (H, D) and value.shape == key.shape, f"key {tuple(key.shape)} vs cache heads {H}x{D}")
    slots = slot_indices.long()
    key_cache.view(-1, H, D)[slots] = key
    value_cache.view(-1, H, D)[slots] = value


def _gather(cache: torch.Tensor, block_table: torch.Tensor, blocks: int) -> torch.Tensor:
    """`[B, blocks * block_size, H, D]` from `[nb, bs, H, D]` through the block table's first columns."""
    nb, bs, H, D = cache.shape
    return cache[block_table[:, :blocks].long()].reshape(block_table.shape[0], blocks * bs, H, D)


@_op(host=("context_lens",))
def _npu_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         num_kv_heads: int, num_heads: int, scale_value: float, block_table: torch.Tensor,
                         context_lens: torch.Tensor, out: torch.Tensor) -> None:
    """ATB PagedAttention (decode), as vllm-ascend calls it (attention_v1.py `_forward_decode_only`:
    `torch_npu._npu_paged_attention(query=, key_cache=, value_cache=, num_kv_heads=, num_heads=,
    scale_value=, block_table=, context_lens=, out=)`): query `[B, Hq, D]`, caches `[nb, bs, Hkv, D]`,
    block_table int32 `[B, W]` on the device, context_lens int32 `[B]` on the HOST (vllm-ascend passes
    `seq_lens` kept on the CPU), each >= 1; writes `out` `[B, Hq, D]`. Reads cdiv(max(context_lens), bs)
    blocks per row (recorded as `LAST[...]["blocks_read"]`), whatever the table's width."""
    _check(context_lens.device.type == "cpu" and context_lens.dtype == torch.int32,
           "context_lens must be an int32 host tensor")
    _check(block_table.dtype == torch.int32, f"block_table must be int32, got {block_table.dtype}")
    B, Hq, D = query.shape
    _check(num_heads == Hq and key_cache.shape[2] == num_kv_heads, "head counts do not match the tensors")
    _check(context_lens.shape == (B,) and block_table.shape[0] == B, "one context length and table row per query")
    lens = context_lens.long()
    _check(bool((lens >= 1).all()), "context_lens must be >= 1")
    bs = key_cache.shape[1]
    blocks = -(-int(lens.max()) // bs)
    _check(blocks <= block_table.shape[1], "context longer than the block table")
    LAST["_npu_paged_attention"]["blocks_read"] = blocks
    k = _gather(key_cache, block_table, blocks).float()       # [B, L, Hkv, D]
    v = _gather(value_cache, block_table, blocks).float()
    G = Hq // num_kv_heads
    q = query.float().view(B, num_kv_heads, G, D)
    scores = torch.einsum("bhgd,blhd->bhgl", q, k) * scale_value
    valid = torch.arange(blocks * bs)[None, :] < lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    o = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), v)
    out.copy_(o.reshape(B, Hq, D).to(out.dtype))


@_op(host=("actual_seq_lengths", "actual_seq_lengths_kv"))
def npu_fused_infer_attention_score(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, pse_shift: torch.Tensor | None = None,
        atten_mask: torch.Tensor | None = None, actual_seq_lengths: list[int] | None = None,
        actual_seq_lengths_kv: list[int] | None = None, block_table: torch.Tensor | None = None,
        num_heads: int = 1, scale: float = 1.0, pre_tokens: int = 2147483647, next_tokens: int = 2147483647,
        input_layout: str = "BSH", num_key_value_heads: int = 0, sparse_mode: int = 0, inner_precise: int = 0,
        block_size: int = 0, antiquant_mode: int = 0, softmax_lse_flag: bool = False
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu.npu_fused_infer_attention_score (API reference, ptaoplist_001232: `(query, key, value, *,
    ..., atten_mask, actual_seq_lengths, actual_seq_lengths_kv, ..., block_table, ..., num_heads, scale,
    pre_tokens, next_tokens, input_layout, num_key_value_heads, sparse_mode, inner_precise, block_size, ...)
    -> (attention_out, softmax_lse)`), the subset the backend uses: input_layout "TND" (query `[T, N, D]`,
    actual_seq_lengths = cumulative query ends per batch), paged KV (key/value `[num_blocks, block_size,
    Hkv * D]`, block_table int32 `[B, W]`, actual_seq_lengths_kv = each batch's KV length), host int lists.
    sparse_mode 3: right-down causal; 4: band right-down, a query at kv position p sees (p - pre_tokens ..
    p + next_tokens); both need the [2048, 2048] bool atten_mask (1 = masked, upper triangle)."""
    _check(input_layout == "TND", f"the double implements input_layout TND only, got {input_layout!r}")
    _check(block_table is not None and block_table.dtype == torch.int32, "paged KV needs an int32 block_table")
    _check(isinstance(actual_seq_lengths, list) and isinstance(actual_seq_lengths_kv, list),
           "actual_seq_lengths(_kv) are host int lists")
    assert block_table is not None and actual_seq_lengths is not None and actual_seq_lengths_kv is not None
    _check(sparse_mode in (3, 4), f"the double implements sparse_mode 3 and 4, got {sparse_mode}")
    _check(atten_mask is not None and atten_mask.dtype == torch.bool
           and tuple(atten_mask.shape) == (FIA_MASK_SIZE, FIA_MASK_SIZE), "sparse_mode 3/4 need the 2048x2048 mask")
    T, N, D = query.shape
    nb, bs, HD = key.shape
    Hkv = num_key_value_heads or num_heads
    _check(N == num_heads and HD == Hkv * D and bs == block_size, "shapes do not match num_heads/block_size")
    _check(len(actual_seq_lengths) == len(actual_seq_lengths_kv) == block_table.shape[0], "one length per batch")
    _check(actual_seq_lengths[-1] <= T, "actual_seq_lengths exceed the query tokens")
    kc, vc = key.view(nb, bs, Hkv, D), value.view(nb, bs, Hkv, D)
    out = torch.zeros_like(query)
    start = 0
    for b, (end, kv_len) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
        n = end - start
        if n:
            blocks = -(-kv_len // bs)
            k = _gather(kc, block_table[b:b + 1], blocks)[0, :kv_len].float().repeat_interleave(N // Hkv, 1)
            v = _gather(vc, block_table[b:b + 1], blocks)[0, :kv_len].float().repeat_interleave(N // Hkv, 1)
            qpos = torch.arange(kv_len - n, kv_len)[:, None]    # right-down aligned
            kpos = torch.arange(kv_len)[None, :]
            allowed = kpos <= qpos + (next_tokens if sparse_mode == 4 else 0)
            if sparse_mode == 4:
                allowed &= kpos >= qpos - pre_tokens
            s = torch.einsum("qnd,knd->nqk", query[start:end].float(), k) * scale
            s = s.masked_fill(~allowed[None], float("-inf"))
            out[start:end] = torch.einsum("nqk,knd->qnd", s.softmax(-1), v).to(out.dtype)
        start = end
    return out, torch.zeros(1)


# ---- fused elementwise ops ---------------------------------------------------------------
@_op()
def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_npu.npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor): RmsNorm
    over the last dims of gamma's rank, computed in float32: (y, rstd), rstd with the normalised dims kept as 1."""
    x = self.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (gamma * (x * rstd).to(self.dtype)).to(self.dtype), rstd


@_op()
def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_npu.npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (y, rstd, x):
    x = x1 + x2, then RmsNorm of x (vllm-ascend's AscendRMSNorm with a residual)."""
    x = x1 + x2
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (gamma * (xf * rstd).to(x.dtype)).to(x.dtype), rstd, x


@_op()
def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
                   ) -> torch.Tensor:
    """torch_npu.npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half'): 4-D input,
    r1 (cos) and r2 (sin) broadcastable to it; "half": input * r1 + rotate_half(input) * r2."""
    _check(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul takes 4-D tensors")
    _check(rotary_mode == "half", f"the double implements rotary_mode 'half', got {rotary_mode!r}")
    half = input.shape[-1] // 2
    rotated = torch.cat((-input[..., half:], input[..., :half]), dim=-1)
    return input * r1 + rotated * r2


@_op()
def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch_npu.npu_swiglu(Tensor input, int dim=-1): input split in two halves a, b along dim ->
    silu(a) * b (computed in float32, returned in input's dtype)."""
    a, b = input.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(input.dtype)


# ---- HCCL: torch_npu registers the "hccl" torch.distributed backend; the double's is gloo ----
def _hccl_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """The collective-communication group of the emulated devices (host tensors): a gloo group."""
    from torch.distributed import ProcessGroupGloo
    return ProcessGroupGloo(store, rank, size, timeout)


def _register_hccl() -> None:
    import torch.distributed as dist
    if dist.is_available() and not hasattr(dist.Backend, "HCCL"):
        dist.Backend.register_backend("hccl", _hccl_group, devices=["cpu"])


# ---- importing torch_npu registers `torch.npu` and hccl --------------------------------------
from torch_npu import npu  # noqa: E402

torch.npu = npu  # type: ignore[attr-defined]
_register_hccl()


def reset_counters() -> None:
    CALLS.clear()
    REPLAYS.clear()
    LAST.clear()
