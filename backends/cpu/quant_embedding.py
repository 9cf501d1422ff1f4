"""The token embedding in GGUF blocks: a lookup dequantises only the tokens' rows (`quant_rows.cpp`).

`QuantEmbedding` replaces the model's `embed_tokens` (`nn.Embedding`) when the GGUF file stores the
embedding quantized (`quant_linear.quantize_model`): it keeps the blocks, never a dense
`[vocab, hidden]` copy, and each step decodes its `T` rows with one `pr_quant_rows` call (through
`kernel_calls.call`, so a CPU graph records it). When the LM head is tied to the embedding, both
run over one copy of the blocks: the head (`QuantLinear`) owns them, in the r8 layout where its
kernel runs that, and the embedding reads its rows from that layout (the same tensor). The rows
equal the kernel library's `dequantize` of the same blocks, bit for bit.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.kernel_calls import call


def _library() -> ctypes.CDLL:
    lib = kernels.paged_attention_kernel()
    if lib is None:
        raise RuntimeError("the quantized embedding needs the CPU kernel library (no C++ compiler?)")
    return lib


class QuantEmbedding(nn.Module):
    """`forward(input_ids [...]) -> [..., embedding_dim]` in `dtype` (float32 or bfloat16): the rows of a
    `[num_embeddings, embedding_dim]` matrix held as GGUF blocks of GGML type `qtype` (its id
    `type_id`, `quant_linear.QTYPES`; uint8 `blocks`, `[N, row_bytes]`; r8: `quant_linear.repack8`'s
    `[N / 8, group_bytes]`). The blocks are this module's buffer (for a tied embedding the LM head's
    tensor, shared). Ids outside the vocabulary raise IndexError, as `nn.Embedding`'s do."""

    def __init__(self, qtype: str, type_id: int, blocks: torch.Tensor, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype, r8: bool = False) -> None:
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self.lib = _library()
        self.qtype, self.type_id, self.r8, self.dtype = qtype, type_id, r8, dtype
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("blocks", blocks, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids if input_ids.dtype == torch.int64 and input_ids.is_contiguous() else \
            input_ids.contiguous().long()
        out = torch.empty((*ids.shape, self.embedding_dim), dtype=self.dtype)
        rc = call(self.lib.pr_quant_rows, self.type_id, self.blocks.data_ptr(), int(self.r8), self.num_embeddings,
                  self.embedding_dim, ids.data_ptr(), ids.numel(), out.data_ptr(), self.embedding_dim,
                  int(self.dtype == torch.bfloat16))
        if rc == 3:
            raise IndexError(f"index out of range in self (an id outside [0, {self.num_embeddings}))")
        if rc != 0:
            raise RuntimeError(f"pr_quant_rows failed (code {rc}) for {self.extra_repr()}")
        return out

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}, dtype={self.dtype}"
                f"{', r8' if self.r8 else ''}")
