"""The static input buffers a captured graph reads, and the metadata it is captured with.

One set of buffers serves every graph: token-axis buffers hold the largest
graph's T tokens, request-axis buffers its R requests; graph (T, R) reads
`[:T]` / `[:R]`. A step is copied in (`load`) before its graph replays.

Host-side fields of the captured metadata are frozen into the graph, so they
must hold for every step it replays:

- decode graph B: num_actual_tokens = num_reqs = num_decodes = B,
  max_query_len = 1, max_seq_len = the width read (W blocks), STATIC_DECODE set;
- mixed graph (T, R): num_actual_tokens = T, num_reqs = R, num_decodes = 0,
  max_query_len = T (> 1: never an attention's decode-only path), max_seq_len =
  W * block_size. These are bounds, not the step's values: only a
  length-adaptive attention (reading the lengths on the device) is valid here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrunner.attention.batched import STATIC_DECODE
from polyrunner.attention.metadata import AttentionMetadata
from polyrunner.device.backend import ModelInputs


@dataclass
class StaticBuffers:
    """Static inputs sized for the largest graph (T tokens, R requests)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    token_to_req: torch.Tensor

    @classmethod
    def like(cls, inputs: ModelInputs, num_tokens: int, num_reqs: int) -> StaticBuffers:
        """Zeroed buffers with `inputs`' dtypes, devices and block-table width."""
        m = inputs.attn

        def z(t: torch.Tensor, n: int) -> torch.Tensor:
            return torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)

        T, R = num_tokens, num_reqs
        return cls(z(inputs.input_ids, T), z(inputs.positions, T), z(m.slot_mapping, T), z(m.seq_lens, R),
                   z(m.block_tables, R), z(m.query_start_loc, R + 1), z(m.token_to_req, T))

    def load(self, inputs: ModelInputs, T: int, R: int, W: int) -> None:
        """Copy a step padded to (T tokens, R requests); its block table's first W columns
        (the rest stay as they are: a graph reads only W)."""
        m = inputs.attn
        W = min(W, m.block_tables.shape[1])
        self.input_ids[:T].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:T].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:T].copy_(m.slot_mapping, non_blocking=True)
        self.token_to_req[:T].copy_(m.token_to_req, non_blocking=True)
        self.seq_lens[:R].copy_(m.seq_lens, non_blocking=True)
        self.block_tables[:R, :W].copy_(m.block_tables[:, :W], non_blocking=True)
        self.query_start_loc[: R + 1].copy_(m.query_start_loc, non_blocking=True)

    def _meta(self, T: int, R: int, W: int, num_decodes: int, max_query_len: int,
              max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=T, num_reqs=R, num_decodes=num_decodes, max_query_len=max_query_len,
            max_seq_len=max_seq_len, query_start_loc=self.query_start_loc[: R + 1], seq_lens=self.seq_lens[:R],
            block_tables=self.block_tables[:R, :W], slot_mapping=self.slot_mapping[:T],
            positions=self.positions[:T], token_to_req=self.token_to_req[:T])

    def decode_meta(self, B: int, W: int, block_size: int) -> AttentionMetadata:
        """Metadata of decode graph B (B requests of one token; the first W blocks of each)."""
        meta = self._meta(B, B, W, num_decodes=B, max_query_len=1, max_seq_len=W * block_size)
        meta.extras[STATIC_DECODE] = True
        return meta

    def mixed_meta(self, T: int, R: int, W: int, block_size: int) -> AttentionMetadata:
        """Metadata of mixed graph (T, R): host fields are bounds valid for every step (module doc)."""
        return self._meta(T, R, W, num_decodes=0, max_query_len=T, max_seq_len=W * block_size)
