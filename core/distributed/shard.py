"""Which part of each weight a tensor-parallel rank holds (Megatron-style).

- qkv_proj, gate_up_proj: column-parallel — each rank holds its heads' rows
  (q heads split evenly; KV heads split evenly, or replicated when there are
  fewer KV heads than ranks: rank r holds KV head r * kv_heads // size) and its
  slice of the intermediate rows.
- KV heads that the ranks cannot split evenly (SmolLM2's 3 over 2 ranks) are
  padded with zero heads up to a multiple of the ranks, and the q heads with
  them (each KV head keeps its group of q heads): a padded head's q, k and v
  are zero and its o_proj columns are zero, so it adds nothing to the output.
- mixture of experts (`arch.moe`): each expert's intermediate rows (w1/w3 rows, w2 columns)
  and the shared expert's are split like a dense MLP's (`moe_intermediate`,
  `shared_expert_intermediate` per rank); the router and the shared-expert gate are whole.
  Then the expert width must divide, and `intermediate_size` only where there are dense layers.
- o_proj, down_proj: row-parallel — each rank holds the matching input columns;
  the partial outputs are summed by an all-reduce. A bias is added once (rank 0).
- embed_tokens, lm_head: vocabulary-parallel — each rank holds a contiguous
  range of ceil(vocab / size) rows (the last range padded with zero rows); the
  embedding sums masked lookups with an all-reduce, the logits are gathered.

`TPShard.of(arch, rank, size)` validates the split and names what does not
divide; `TPShard.single(arch)` is the whole model (no parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrunner.models.arch import DecoderArch
from polyrunner.numeric import cdiv


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int
    num_heads: int           # q heads on this rank
    num_kv_heads: int        # KV heads on this rank
    q_head_start: int
    kv_head_start: int
    intermediate: int        # MLP intermediate rows on this rank
    vocab_size: int          # the whole vocabulary
    vocab_per_rank: int      # rows of embed_tokens / lm_head on this rank (padded)
    head_dim: int
    total_heads: int = 0     # the model's q heads (those past it on a rank are zero padding)
    total_kv_heads: int = 0
    moe_intermediate: int = 0            # each expert's intermediate rows on this rank (0: no experts)
    shared_expert_intermediate: int = 0  # the shared expert's (0: none)

    @classmethod
    def single(cls, arch: DecoderArch) -> TPShard:
        return cls.of(arch, 0, 1)

    @classmethod
    def of(cls, arch: DecoderArch, rank: int, size: int) -> TPShard:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} of size {size}: rank must be in [0, {size - 1}]")
        heads, kv = arch.num_heads, arch.num_kv_heads
        moe = arch.moe
        widths = [("intermediate_size", arch.intermediate_size)] if moe is None or moe.has_dense_layers else []
        if moe is not None:
            widths += [("expert intermediate size", moe.intermediate),
                       ("shared_expert_intermediate_size", moe.shared_expert_intermediate)]
        for what, width in widths:
            if width % size:   # vLLM's wording
                raise ValueError(f"{what} ({width}) must be divisible by tensor parallel size ({size})")
        group = heads // kv
        kv_padded = kv   # the fewest KV heads (real + zero) the ranks split evenly, or replicate
        while not (kv_padded % size == 0 or size % kv_padded == 0 and kv_padded * group % size == 0):
            kv_padded += 1
        kv_local = kv_padded // size if kv_padded >= size else 1
        kv_start = rank * kv_local if kv_padded >= size else rank * kv_padded // size
        q_local = kv_padded * group // size
        return cls(rank, size, q_local, kv_local, rank * q_local, kv_start, arch.intermediate_size // size,
                   arch.vocab_size, cdiv(arch.vocab_size, size), arch.head_dim, heads, kv,
                   0 if moe is None else moe.intermediate // size,
                   0 if moe is None else moe.shared_expert_intermediate // size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def slice(self, part: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of checkpoint tensor `part` ("q_proj.weight",
        "down_proj.bias", "embed_tokens.weight", ...: the last two name parts);
        other tensors (norms) are whole."""
        if self.size == 1:
            return tensor
        module, kind = part.rsplit(".", 1)
        if module == "q_proj":
            return self._heads(tensor, 0, self.q_head_start, self.num_heads, self.total_heads)
        if module in ("k_proj", "v_proj"):
            return self._heads(tensor, 0, self.kv_head_start, self.num_kv_heads, self.total_kv_heads)
        if module in ("gate_proj", "up_proj"):
            return tensor.narrow(0, self.rank * self.intermediate, self.intermediate)
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            if module == "o_proj":
                return self._heads(tensor, 1, self.q_head_start, self.num_heads, self.total_heads)
            return tensor.narrow(1, self.rank * self.intermediate, self.intermediate)
        if module in ("embed_tokens", "lm_head"):
            return _rows_padded(tensor, 0, self.vocab_start, self.vocab_per_rank)
        return tensor

    def _heads(self, tensor: torch.Tensor, dim: int, start: int, count: int, total: int) -> torch.Tensor:
        """Heads [start, start + count) along `dim` (zeros for padding heads past `total`)."""
        d = self.head_dim
        return _rows_padded(tensor, dim, start * d, count * d, limit=total * d)


def _rows_padded(tensor: torch.Tensor, dim: int, start: int, count: int, limit: int | None = None) -> torch.Tensor:
    """`tensor[start:start + count]` along `dim`, with zeros past `limit` (default: its size)."""
    limit = tensor.shape[dim] if limit is None else limit
    real = max(0, min(count, limit - start))
    part = tensor.narrow(dim, min(start, limit), real)
    if real == count:
        return part
    shape = list(tensor.shape)
    shape[dim] = count - real
    return torch.cat([part, tensor.new_zeros(shape)], dim=dim)
