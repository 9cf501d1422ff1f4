"""The CPU backend's "moe" override: `CPUFusedMoE`, one C++ call per MoE layer (`moe_experts.cpp`).

`forward(x, router_logits)` is `FusedMoE`'s: routing, the experts' gated MLPs and the weighted sum
run inside `pr_moe` on the kernels' thread pool, through `kernel_calls.call` (so a CPU graph records
it). The module keeps the reference's attributes and its parameters themselves (`w13_weight`
`[E, 2I, H]` gate then up, `w2_weight` `[E, H, I]`, unpacked: the kernel reads that layout). The
factory `MoEOverride` gives the modules of one shape one scratch buffer, sized once for chunks of
`chunk_tokens(...)` tokens (no allocation per call; layers run one at a time).

`QuantFusedMoE` is the same call over experts kept in GGUF blocks (a quantized GGUF file's 3-D
gate, up and down stacks, as the file holds them, swapped in by `quant_linear.quantize_model`
before any weight is read): one `pr_moe_quant` call per layer, routing and weighted sum as
`pr_moe`'s, each active expert's rows through the quantized linear kernels (int8 activations, like
every `QuantLinear`), so a decode step reads only its active experts' blocks. It holds no dense
weight (no `w13_weight` / `w2_weight`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.kernel_calls import call
from polyrunner.plugin_api import FusedMoE, keep_moe_attributes

SCRATCH_BUDGET = 32 << 20   # bytes of scratch per layer shape: the tokens of one pass of the kernel
SCORINGS = {"softmax": 0, "sigmoid": 1}
ScratchKey = tuple[int, int, int, int]   # (hidden, intermediate, experts, top_k)


class ShapeScratch:
    """One kernel scratch buffer per layer shape, shared by the layers of that shape (they run one at a
    time): `get(lib, hidden, intermediate, experts, top_k) -> (buffer, chunk)`, made on first use for
    `chunk_of(hidden, intermediate, top_k)` tokens per kernel pass, of the bytes the library's
    `bytes_fn(chunk, hidden, intermediate, experts, top_k)` says."""

    def __init__(self, chunk_of: Callable[[int, int, int], int], bytes_fn: str) -> None:
        self.chunk_of, self.bytes_fn = chunk_of, bytes_fn
        self.buffers: dict[ScratchKey, tuple[torch.Tensor, int]] = {}

    def get(self, lib: ctypes.CDLL, hidden: int, intermediate: int, experts: int, top_k: int
            ) -> tuple[torch.Tensor, int]:
        key = (hidden, intermediate, experts, top_k)
        if key not in self.buffers:
            chunk = self.chunk_of(hidden, intermediate, top_k)
            self.buffers[key] = torch.empty(getattr(lib, self.bytes_fn)(chunk, *key), dtype=torch.uint8), chunk
        return self.buffers[key]


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
        self.scratch = ShapeScratch(lambda h, i, k: chunk_tokens(h, i, k, max_tokens), "pr_moe_scratch_bytes")

    def __call__(self, module: nn.Module) -> nn.Module:
        lib = kernels.paged_attention_kernel()
        if (lib is None or type(module) is not FusedMoE or module.w13_weight.dtype not in kernels.DTYPES
                or module.w2_weight.dtype != module.w13_weight.dtype or module.w13_weight.device.type != "cpu"
                or not (module.w13_weight.is_contiguous() and module.w2_weight.is_contiguous())):
            return module
        _, _, hidden = module.w13_weight.shape
        if hidden > 8192 or module.num_experts > 1024:   # pr_moe's limits
            return module
        scratch, chunk = self.scratch.get(lib, hidden, module.intermediate, module.num_experts, module.top_k)
        return CPUFusedMoE(module, lib, scratch, chunk)


# ---- experts in GGUF blocks -----------------------------------------------------------

QUANT_MAX_TOKENS = 2048   # tokens per pass at most (the scratch is sized once, before the scheduler's budget is known)


class QuantStack(NamedTuple):
    """One weight stack of `QuantFusedMoE`: GGML type `qtype` (its id `type_id`, `quant_linear.QTYPES`),
    uint8 `blocks` `[E, rows, row_bytes]`, or with `r8` each expert's rows in the r8 layout
    (`[E, rows / 8, group_bytes]`, `quant_linear.repack8`)."""

    qtype: str
    type_id: int
    blocks: torch.Tensor
    r8: bool


def quant_chunk_tokens(hidden: int, intermediate: int, top_k: int, max_tokens: int = QUANT_MAX_TOKENS) -> int:
    """Tokens per `pr_moe_quant` pass: as many as `SCRATCH_BUDGET` holds (per routed pair its float32
    x, gate_up and output rows), at most `max_tokens`, at least 1."""
    per_token = top_k * (8 * hidden + 8 * intermediate + 16)
    return max(1, min(max_tokens, SCRATCH_BUDGET // per_token))


class QuantFusedMoE(nn.Module):
    """`FusedMoE`'s call (`forward(x [T, H], router_logits [T, E]) -> [T, H]`, x's dtype) over experts in
    GGUF blocks: `gate` and `up` (each expert's I rows of H; one type and layout) and `down` (H rows
    of I), run on the quantized kernels' path `isa` (`quant_linear.ISAS`); the role's attributes but
    the weights (`num_experts`, `top_k`, `intermediate`, `renormalize`, `scoring`) are `moe`'s; the
    blocks are buffers (`qtypes`, `r8`: gate/up's and down's). `scratch` and `chunk`:
    `QuantMoEScratch`'s, shared by the layers of one shape."""

    def __init__(self, moe: FusedMoE, hidden: int, gate: QuantStack, up: QuantStack, down: QuantStack, isa: int,
                 lib: ctypes.CDLL, scratch: torch.Tensor, chunk: int) -> None:
        super().__init__()
        if (gate.qtype, gate.r8) != (up.qtype, up.r8):
            raise ValueError(f"gate ({gate.qtype}{' r8' if gate.r8 else ''}) and up ({up.qtype}"
                             f"{' r8' if up.r8 else ''}) must share a type and layout")
        keep_moe_attributes(self, moe, weights=False)
        self.hidden, self.isa, self.lib, self.scratch, self.chunk = hidden, isa, lib, scratch, chunk
        self.qtypes, self.r8 = (gate.qtype, down.qtype), (gate.r8, down.r8)
        self._type_ids = (gate.type_id, down.type_id)
        self.register_buffer("gate_blocks", gate.blocks, persistent=False)
        self.register_buffer("up_blocks", up.blocks, persistent=False)
        self.register_buffer("down_blocks", down.blocks, persistent=False)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if x.dtype not in kernels.DTYPES or x.dim() != 2 or x.stride(-1) != 1:   # not a step's rows: made so
            return self.forward(x.reshape(-1, self.hidden).float().contiguous(), router_logits).to(x.dtype)
        if router_logits.dtype not in kernels.DTYPES or router_logits.stride(-1) != 1:
            router_logits = router_logits.float().contiguous()
        tokens = x.shape[0]
        out = torch.empty((tokens, self.hidden), dtype=x.dtype)
        rc = call(self.lib.pr_moe_quant, kernels.DTYPES[x.dtype], x.data_ptr(), x.stride(0), router_logits.data_ptr(),
                  router_logits.stride(0), int(router_logits.dtype == torch.bfloat16), self._type_ids[0],
                  self.gate_blocks.data_ptr(), self.up_blocks.data_ptr(), int(self.r8[0]), self._type_ids[1],
                  self.down_blocks.data_ptr(), int(self.r8[1]), self.isa, out.data_ptr(), out.stride(0), tokens,
                  self.hidden, self.intermediate,
                  self.num_experts, self.top_k, int(self.renormalize), SCORINGS[self.scoring],
                  self.scratch.data_ptr(), self.chunk)
        if rc != 0:
            raise RuntimeError(f"CPU quantized MoE kernel failed (code {rc}) for {self.extra_repr()}")
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, intermediate={self.intermediate}, "
                f"hidden={self.hidden}, gate/up={self.qtypes[0]}{' r8' if self.r8[0] else ''}, "
                f"down={self.qtypes[1]}{' r8' if self.r8[1] else ''}, chunk={self.chunk}")


class QuantMoEScratch(ShapeScratch):
    """`ShapeScratch` for `QuantFusedMoE`s: passes of at most `max_tokens` tokens."""

    def __init__(self, max_tokens: int = QUANT_MAX_TOKENS) -> None:
        super().__init__(lambda h, i, k: quant_chunk_tokens(h, i, k, max_tokens), "pr_moe_quant_scratch_bytes")
