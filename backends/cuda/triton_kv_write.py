"""Triton kernel: write this step's keys and values into their KV-cache slots.

One program per token: token t's `[Hkv, D]` keys and values go to block
`slot_mapping[t] // block_size`, offset `slot_mapping[t] % block_size`, cast
to the cache dtype. A negative slot is skipped (vLLM's padding convention);
our padded tokens write the null slot 0, whose contents are never read as
context. Any strides are accepted (the cache's logical layout is
`[2, num_blocks, block_size, Hkv, D]`). Importing this module imports triton:
the plugin imports it only when triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     k_st, k_sh, k_sd, v_st, v_sh, v_sd,
                     kc_sb, kc_ss, kc_sh, kc_sd, vc_sb, vc_ss, vc_sh, vc_sd,
                     NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_SIZE)[None, :]
    key = tl.load(k_ptr + t * k_st + h[:, None] * k_sh + d[None, :] * k_sd, mask=mask)
    value = tl.load(v_ptr + t * v_st + h[:, None] * v_sh + d[None, :] * v_sd, mask=mask)
    tl.store(kc_ptr + block * kc_sb + offset * kc_ss + h[:, None] * kc_sh + d[None, :] * kc_sd,
             key.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + block * vc_sb + offset * vc_ss + h[:, None] * vc_sh + d[None, :] * vc_sd,
             value.to(vc_ptr.dtype.element_ty), mask=mask)


def triton_write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Scatter k/v `[T_pad, Hkv, D]` into `kv_cache` `[2, NB, bs, Hkv, D]` at
    `slot_mapping` `[T_pad]` (int32/int64; negative = skip). Same result as
    `polyrunner.plugin_api.write_kv`; no host synchronisation (graph-safe)."""
    T, num_kv, head = k.shape
    if slot_mapping.shape[0] < T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    if T == 0:
        return
    kc, vc = kv_cache[0], kv_cache[1]
    _kv_write_kernel[(T,)](
        k, v, kc, vc, slot_mapping,
        *k.stride(), *v.stride(), *kc.stride(), *vc.stride(),
        NUM_KV_HEADS=num_kv, HEADS_PAD=triton.next_power_of_2(num_kv),
        HEAD_SIZE=head, HEAD_PAD=triton.next_power_of_2(head), BLOCK_SIZE=kv_cache.shape[2])
