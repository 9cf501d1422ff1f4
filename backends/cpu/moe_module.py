"""The CPU backend's "moe" override: `CPUFusedMoE`, one C++ call per MoE layer (`moe_experts.cpp`).

`forward(x, router_logits)` is `FusedMoE`'s: routing, the experts' gated MLPs and the weighted sum
run inside `pr_moe` on the kernels' thread pool, through `kernel_calls.call` (so a CPU graph records
it). The module keeps the reference's attributes and its parameters themselves (`w13_weight`
`[E, 2I, H]` gate then up, `w2_weight` `[E, H, I]`, unpacked: the kernel reads that layout). The
factory `MoEOverride` gives the modules of one shape one scratch buffer, sized once for chunks of
`chunk_tokens(...)` tokens (no allocation per call; layers run one at a time).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.kernel_calls import call
from polyrunner.plugin_api import FusedMoE, keep_moe_attributes

SCRATCH_BUDGET = 32 << 20   # bytes of scratch per layer shape: the tokens of one pass of the kernel
SCORINGS = {"softmax": 0, "sigmoid": 1}
ScratchKey = tuple[int, int, int, int]   # (hidden, intermediate, experts, top_k)


def chunk_tokens(hidden: int, intermediate: int, top_k: int, max_tokens: int) -> int:
    """Tokens per kernel pass: as many as `SCRATCH_BUDGET` holds (each needs float32 x, and per
    routed pair its activation and output rows), at most `max_tokens`, at least 1."""
    per_token = 4 * hidden + top_k * (4 * (intermediate + hidden) + 16)
    return max(1, min(max_tokens, SCRATCH_BUDGET // per_token))


class CPUFusedMoE(nn.Module):
    """`FusedMoE` as one `pr_moe` call; `lib`: the kernel library, `scratch` and `chunk` from
    `MoEOverride`. Inputs it does not take (another dtype, a row stride) run the reference."""

    def __init__(self, moe: FusedMoE, lib: ctypes.CDLL, scratch: torch.Tensor, chunk: int) -> None:
        super().__init__()
        keep_moe_attributes(self, moe)
        self.reference = [moe]   # a list: not a submodule (its parameters are ours)
        self.lib, self.scratch, self.chunk = lib, scratch, chunk

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        dtype = self.w13_weight.dtype
        if (x.dtype != dtype or x.dim() != 2 or x.stride(-1) != 1 or router_logits.stride(-1) != 1
                or router_logits.dtype not in (torch.float32, dtype)):
            reference: torch.Tensor = self.reference[0](x, router_logits)
            return reference
        tokens, hidden = x.shape
        out = torch.empty((tokens, hidden), dtype=dtype)
        rc = call(self.lib.pr_moe, kernels.DTYPES[dtype], x.data_ptr(), x.stride(0), router_logits.data_ptr(),
                  router_logits.stride(0), int(router_logits.dtype == torch.bfloat16), self.w13_weight.data_ptr(),
                  self.w2_weight.data_ptr(), out.data_ptr(), out.stride(0), tokens, hidden, self.intermediate,
                  self.num_experts, self.top_k, int(self.renormalize), SCORINGS[self.scoring],
                  self.scratch.data_ptr(), self.chunk)
        if rc != 0:
            raise RuntimeError(f"CPU MoE kernel failed (code {rc}) for {self.extra_repr()}")
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate}, "
                f"renormalize={self.renormalize}, scoring={self.scoring!r}, chunk={self.chunk}")


class MoEOverride:
    """The "moe" factory: a `FusedMoE` with contiguous float32 or bfloat16 weights -> `CPUFusedMoE`
    (the kernel library loaded: `kernels.paged_attention_kernel()`); anything else is kept.
    `max_tokens`: the most tokens a step passes (the scheduler's token budget)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.scratch: dict[ScratchKey, tuple[torch.Tensor, int]] = {}

    def __call__(self, module: nn.Module) -> nn.Module:
        lib = kernels.paged_attention_kernel()
        if (lib is None or type(module) is not FusedMoE or module.w13_weight.dtype not in kernels.DTYPES
                or module.w2_weight.dtype != module.w13_weight.dtype or module.w13_weight.device.type != "cpu"
                or not (module.w13_weight.is_contiguous() and module.w2_weight.is_contiguous())):
            return module
        _, _, hidden = module.w13_weight.shape
        if hidden > 8192 or module.num_experts > 1024:   # pr_moe's limits
            return module
        key = (hidden, module.intermediate, module.num_experts, module.top_k)
        if key not in self.scratch:
            chunk = chunk_tokens(hidden, module.intermediate, module.top_k, self.max_tokens)
            size = lib.pr_moe_scratch_bytes(chunk, *key)
            self.scratch[key] = torch.empty(size, dtype=torch.uint8), chunk
        scratch, chunk = self.scratch[key]
        return CPUFusedMoE(module, lib, scratch, chunk)
