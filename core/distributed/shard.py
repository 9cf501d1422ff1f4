"""Which part of each weight a tensor-parallel rank holds (Megatron-style).

- qkv_proj, gate_up_proj: column-parallel — each rank holds its heads' rows
  (q heads split evenly; KV heads split evenly, or replicated when there are
  fewer KV heads than ranks: rank r holds KV head r * kv_heads // size) and its
  slice of the intermediate rows.
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

    @classmethod
    def single(cls, arch: DecoderArch) -> TPShard:
        return cls.of(arch, 0, 1)

    @classmethod
    def of(cls, arch: DecoderArch, rank: int, size: int) -> TPShard:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} of size {size}: rank must be in [0, {size - 1}]")
        heads, kv = arch.num_heads, arch.num_kv_heads
        problems = []
        if heads % size:
            problems.append(f"num_attention_heads ({heads})")
        if arch.intermediate_size % size:
            problems.append(f"intermediate_size ({arch.intermediate_size})")
        if kv >= size and kv % size or kv < size and size % kv:
            problems.append(f"num_key_value_heads ({kv}) (it must divide or be divisible by it)")
        if problems:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {', '.join(problems)}")
        kv_local = kv // size if kv >= size else 1
        kv_start = rank * kv_local if kv >= size else rank * kv // size
        return cls(rank, size, heads // size, kv_local, rank * (heads // size), kv_start,
                   arch.intermediate_size // size, arch.vocab_size, -(-arch.vocab_size // size), arch.head_dim)

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
        d = self.head_dim
        if module == "q_proj":
            return tensor.narrow(0, self.q_head_start * d, self.q_size)
        if module in ("k_proj", "v_proj"):
            return tensor.narrow(0, self.kv_head_start * d, self.kv_size)
        if module in ("gate_proj", "up_proj"):
            return tensor.narrow(0, self.rank * self.intermediate, self.intermediate)
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            width = self.q_size if module == "o_proj" else self.intermediate
            return tensor.narrow(1, self.rank * width, width)
        if module in ("embed_tokens", "lm_head"):
            rows = tensor[self.vocab_start:self.vocab_start + self.vocab_per_rank]
            if rows.shape[0] < self.vocab_per_rank:   # the last range: zero rows past the vocabulary
                pad = tensor.new_zeros(self.vocab_per_rank - rows.shape[0], *tensor.shape[1:])
                rows = torch.cat([rows, pad])
            return rows
        return tensor
