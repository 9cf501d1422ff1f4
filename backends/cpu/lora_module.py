"""The CPU backend's "lora" override: `CPULoRALinear`, the base linear then one C++ call per LoRA
linear (`lora_kernel.cpp`).

`forward(x)` is `LoRALinear`'s: `base(x)` first (the base may itself be an override: a packed or
quantized linear), then `pr_lora` adds each token's adapter update to that output in place, on the
kernels' thread pool, through `kernel_calls.call` (so a CPU graph records it: the replay reads
`mapping.token_lora`, `lora_a` and `lora_b` at their addresses, which the runner writes in place).
The module keeps the reference's attributes and its parameters themselves. The factory
`LoRAOverride` gives the modules of one shape one scratch buffer, sized once for chunks of
`chunk_tokens(...)` tokens (no allocation per call; layers run one at a time).

The "lora_embedding" override, `CPULoRAEmbedding`, is the embeddings' adapters as one `pr_lora_embed`
call adding to the looked-up embeddings in place (recorded in CPU graphs the same way).
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable

import torch
from torch import nn

from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.kernel_calls import call
from polyrunner.plugin_api import (
    EngineConfig,
    LoRAEmbedding,
    LoRALinear,
    LoRAMapping,
    add_lora,
    add_lora_embedding,
    keep_lora_attributes,
)

SCRATCH_BUDGET = 8 << 20   # bytes of scratch per layer shape: the tokens of one pass of the kernel
MAX_LORAS = 256            # pr_lora's limit on slots
ScratchKey = tuple[int, int, int, int]   # (in_features, slots, slices, max_rank)


def chunk_tokens(in_features: int, slices: int, max_rank: int, max_tokens: int) -> int:
    """Tokens per kernel pass: as many as `SCRATCH_BUDGET` holds (each needs float32 x and its
    shrink row), at most `max_tokens`, at least 1."""
    per_token = 4 * (in_features + slices * max_rank) + 4
    return max(1, min(max_tokens, SCRATCH_BUDGET // per_token))


class CPULoRALinear(nn.Module):
    """`LoRALinear` as `base(x)` plus one `pr_lora` call; `lib`: the kernel library, `scratch` and
    `chunk` from `LoRAOverride`. Inputs it does not take (another dtype, a row stride, a base
    output in another dtype) add the updates by the reference `add_lora`."""

    base: nn.Module
    in_features: int
    output_slices: tuple[int, ...]
    max_rank: int
    mapping: LoRAMapping
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, lora: nn.Module, lib: ctypes.CDLL, scratch: torch.Tensor, chunk: int) -> None:
        super().__init__()
        keep_lora_attributes(self, lora)
        self.lib, self.scratch, self.chunk = lib, scratch, chunk
        self.out_features = sum(self.output_slices)
        self.bounds = torch.tensor([0, *itertools.accumulate(self.output_slices)], dtype=torch.int64)

    @property
    def max_loras(self) -> int:
        return int(self.lora_a.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        tokens = x.shape[0]
        token_lora = self.mapping.token_lora[:tokens]
        dtype = self.lora_a.dtype
        if (x.dtype != dtype or y.dtype != dtype or x.dim() != 2 or y.dim() != 2 or x.stride(-1) != 1
                or y.stride(-1) != 1 or token_lora.dtype != torch.int32 or token_lora.device.type != "cpu"):
            return add_lora(y, x, self.lora_a, self.lora_b, token_lora)
        rc = call(self.lib.pr_lora, kernels.DTYPES[dtype], x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
                  token_lora.data_ptr(), self.lora_a.data_ptr(), self.lora_b.data_ptr(), self.bounds.data_ptr(),
                  tokens, self.in_features, self.out_features, self.max_loras, len(self.output_slices),
                  self.max_rank, self.scratch.data_ptr(), self.chunk)
        if rc != 0:
            raise RuntimeError(f"CPU LoRA kernel failed (code {rc}) for {self.extra_repr()}")
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, output_slices={self.output_slices}, max_loras={self.max_loras}, "
                f"max_rank={self.max_rank}, chunk={self.chunk}")


class LoRAOverride:
    """The "lora" factory: a `LoRALinear` with contiguous float32 or bfloat16 adapter slots on the
    CPU -> `CPULoRALinear` (the kernel library loaded: `kernels.paged_attention_kernel()`); anything
    else is kept. `max_tokens`: the most tokens a step passes (the scheduler's token budget)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.scratch: dict[ScratchKey, tuple[torch.Tensor, int]] = {}

    def __call__(self, module: nn.Module) -> nn.Module:
        lib = kernels.paged_attention_kernel()
        if (lib is None or type(module) is not LoRALinear or module.lora_a.dtype not in kernels.DTYPES
                or module.lora_b.dtype != module.lora_a.dtype or module.lora_a.device.type != "cpu"
                or not (module.lora_a.is_contiguous() and module.lora_b.is_contiguous())
                or module.max_loras > MAX_LORAS):
            return module
        key = (module.in_features, module.max_loras, len(module.output_slices), module.max_rank)
        if key not in self.scratch:
            in_features, slots, slices, rank = key
            chunk = chunk_tokens(in_features, slices, rank, self.max_tokens)
            size = lib.pr_lora_scratch_bytes(chunk, in_features, slots, slices, rank)
            self.scratch[key] = torch.empty(size, dtype=torch.uint8), chunk
        scratch, chunk = self.scratch[key]
        return CPULoRALinear(module, lib, scratch, chunk)


class CPULoRAEmbedding(nn.Module):
    """`LoRAEmbedding` as one `pr_lora_embed` call on the embeddings (in place); inputs it does not
    take (another dtype, int32 ids, a row stride) go through the reference `add_lora_embedding`."""

    mapping: LoRAMapping
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(self, emb: nn.Module, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.mapping, self.lora_a, self.lora_b = emb.mapping, emb.lora_a, emb.lora_b
        self.lib = lib

    def forward(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        token_lora = self.mapping.token_lora[:tokens]
        dtype = self.lora_a.dtype
        if (x.dtype != dtype or x.dim() != 2 or x.stride(-1) != 1 or input_ids.dtype != torch.int64
                or not input_ids.is_contiguous() or token_lora.dtype != torch.int32
                or token_lora.device.type != "cpu"):
            return add_lora_embedding(x, input_ids, self.lora_a, self.lora_b, token_lora)
        slots, vocab, rank = self.lora_a.shape
        rc = call(self.lib.pr_lora_embed, kernels.DTYPES[dtype], input_ids.data_ptr(), x.data_ptr(), x.stride(0),
                  token_lora.data_ptr(), self.lora_a.data_ptr(), self.lora_b.data_ptr(), tokens, vocab,
                  x.shape[1], slots, rank)
        if rc != 0:
            raise RuntimeError(f"CPU LoRA embedding kernel failed (code {rc}) for {self.extra_repr()}")
        return x

    def extra_repr(self) -> str:
        slots, vocab, rank = self.lora_a.shape
        return f"vocab={vocab}, hidden={self.lora_b.shape[1]}, max_loras={slots}, max_rank={rank}"


def embedding_override(module: nn.Module) -> nn.Module:
    """The "lora_embedding" factory: a `LoRAEmbedding` with contiguous float32 or bfloat16 slots on
    the CPU -> `CPULoRAEmbedding`; anything else is kept."""
    lib = kernels.paged_attention_kernel()
    if (lib is None or type(module) is not LoRAEmbedding or module.lora_a.dtype not in kernels.DTYPES
            or module.lora_b.dtype != module.lora_a.dtype or module.lora_a.device.type != "cpu"
            or not (module.lora_a.is_contiguous() and module.lora_b.is_contiguous())):
        return module
    return CPULoRAEmbedding(module, lib)


def lora_overrides(config: EngineConfig, dtype: torch.dtype) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """{"lora": LoRAOverride, "lora_embedding": embedding_override} for a float32 or bfloat16 model
    when LoRA is enabled (`config.lora`; the core adds the LoRA modules only then) and the kernel
    library is there, else {}."""
    if (getattr(config, "lora", None) is None or dtype not in kernels.DTYPES
            or kernels.paged_attention_kernel() is None):
        return {}
    return {"lora": LoRAOverride(max(64, config.scheduler.max_num_batched_tokens)),
            "lora_embedding": embedding_override}
