"""LoRA on the LM head: peft's `lm_head` adapter, a linear one on the logits.

`LoRALogits` holds `max_loras` zero-padded slots like `LoRALinear` and reads each logits row's
slot from the model's `LoRAMapping.logits_lora`. Logits are computed outside the captured
graphs, so it runs only the slots that hold an LM-head adapter (`slots`, kept by the
manager): nothing when no adapter has one. Tensor parallelism: B is cut to the rank's
vocabulary range like the LM head itself.
"""

from __future__ import annotations

import torch
from torch import nn

from polyrunner.ops.lora import LoRAMapping, slot_parameter


class LoRALogits(nn.Module):
    """`forward(hidden [N, H], logits [N, V]) -> [N, V]`: logits plus each row's LM-head update
    (`a [L, R, H]`, `b [L, V, R]` scaled; V: this rank's vocabulary range)."""

    def __init__(self, vocab: int, hidden: int, max_loras: int, max_rank: int, mapping: LoRAMapping,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.mapping = mapping
        self.a = slot_parameter((max_loras, max_rank, hidden), dtype, device)
        self.b = slot_parameter((max_loras, vocab, max_rank), dtype, device)

        self.slots: list[int] = []   # the slots holding an LM-head adapter

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not self.slots:
            return logits
        rows = self.mapping.logits_lora[: hidden.shape[0]]
        h = hidden.float()
        for slot in self.slots:
            delta = (h @ self.a[slot].float().t()) @ self.b[slot].float().t()
            logits = logits + delta * (rows == slot).unsqueeze(-1)
        return logits
