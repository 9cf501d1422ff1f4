"""Soft-capped paged attention in float64, with an error bound, for the kernels' soft-cap tests.

The direct formula of `LayerSpec.logits_soft_cap` (Gemma 2, vLLM's name): scores
s = scale q.k become cap * tanh(s / cap) before the causal/window mask and the softmax.
The bound is `tolerances.attention_reference`'s on the capped scores: s -> cap tanh(s / cap)
has slope <= 1, so a score's rounding error passes through the cap no larger; the kernels'
tanh adds an absolute error of about cap * 2^-23 (`tanh_abs`, counted with the exp's)."""

from __future__ import annotations

import math

import torch

from polyrunner.attention.reference import causal_mask, gather_context, write_kv
from tolerances import gamma, unit_roundoff


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta, spec,
                      *, p_dtype: torch.dtype | None = None, exp_rel: float = 2.0 ** -20,
                      tanh_abs: float = 2.0 ** -21) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, abs_err) as `tolerances.attention_reference` (float32 kernel arithmetic, the
    output's own rounding left to `assert_close_ulp`), with `spec.logits_soft_cap` applied when set.
    `kv_cache` is not modified; padded rows are zero."""
    f64, u = torch.float64, unit_roundoff(torch.float32)
    u_p = unit_roundoff(p_dtype) if p_dtype is not None else 0.0
    cap = spec.logits_soft_cap
    cache = kv_cache.detach().to("cpu", f64).clone()
    write_kv(cache, k.detach().to("cpu", f64), v.detach().to("cpu", f64), meta.slot_mapping.cpu())
    qd = q.detach().to("cpu", f64)
    out, bound = torch.zeros_like(qd), torch.zeros_like(qd)
    G, D, block_size = spec.num_heads // spec.num_kv_heads, qd.shape[-1], cache.shape[2]
    tables = meta.block_tables.cpu()
    for r in range(meta.num_reqs):
        start, end, L = int(meta.query_start_loc_np[r]), int(meta.query_start_loc_np[r + 1]), int(meta.seq_lens_np[r])
        if end <= start or L <= 0:
            continue
        ck, cv = gather_context(cache, tables[r, :-(-L // block_size)].long(), L)
        ck, cv = ck.repeat_interleave(G, dim=1).transpose(0, 1), cv.repeat_interleave(G, dim=1).transpose(0, 1)
        qr = qd[start:end].transpose(0, 1)
        mask = causal_mask(end - start, L, spec.sliding_window, torch.device("cpu"))
        s = (qr @ ck.transpose(1, 2)) * spec.scale
        s_mag = (qr.abs() @ ck.abs().transpose(1, 2)) * abs(spec.scale)
        extra = exp_rel + u_p
        if cap is not None:
            s = cap * torch.tanh(s / cap)
            extra += cap * tanh_abs + 2 * u * s.abs()   # the kernel's tanh; the divide and multiply by cap
        s = s.masked_fill(~mask, -math.inf)
        p = torch.softmax(s, dim=-1)
        o = p @ cv
        d = gamma(D + 2) * s_mag + 2 * u * (s.amax(-1, keepdim=True) - s).nan_to_num(0, 0, 0) + extra
        pd = torch.where(mask, p * d, 0)
        err = pd @ cv.abs() + pd.sum(-1, keepdim=True) * o.abs() + gamma(2 * L + 8) * (p @ cv.abs() + o.abs())
        err = err * (1 + 2 * float(torch.where(mask, d, 0).max()))
        out[start:end] = o.transpose(0, 1)
        bound[start:end] = err.transpose(0, 1)
    return out, bound
