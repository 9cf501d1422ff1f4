"""The structured-output token bitmask applied to logits, with plain torch ops
(any device): the packed int32 mask [N, ceil(V/32)] (bit j of word w allows
token 32*w + j, xgrammar's layout) is unpacked to a bool mask and the refused
logits are set to -inf. Vocabulary ids past the mask's width are refused."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [N, vocab_size], True = allowed, from a packed int32 bitmask [N, W]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(allowed.shape[0], vocab_size - width, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of `logits` [R, V] with refused tokens at -inf. `bitmask` [N, W]:
    row i masks logits row `rows[i]` (rows None: N == R, row i masks row i)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if rows is None:
        return logits.masked_fill(~allowed, NEG_INF)
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, NEG_INF)
    return out
