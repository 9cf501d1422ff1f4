"""What the sampler needs for one step: device tensors, None when unused.

Built by `SamplingState.make_metadata`; every tensor field is None when no row
of the step uses the feature, so the sampler skips that work entirely.
Row-indexed fields have `num_reqs` rows; sparse features (bad words, logit
bias, min_tokens) are flat (row, token) pairs; penalties cover only the rows
that have one (`penalty_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch


@dataclass
class HostSamplingRows:
    """The step's per-row sampling parameters as host numpy arrays (R rows), for a
    backend that samples over padded static shapes with its own function."""

    greedy: np.ndarray            # [R] bool
    temperature: np.ndarray       # [R] f32 (greedy rows 1.0)
    top_k: np.ndarray             # [R] int64 (vocab_size = off)
    top_p: np.ndarray             # [R] f32
    min_p: np.ndarray             # [R] f32
    seeded: np.ndarray            # [R] bool
    seed: np.ndarray              # [R] uint64: the seed's 64 bits
    num_output_tokens: np.ndarray  # [R] int64, before this step's token
    min_tokens: np.ndarray        # [R] int64
    stop_ids: list[np.ndarray | None]  # [R] stop/EOS ids masked until min_tokens (None: none)
    num_logprobs: np.ndarray      # [R] int64, -1 = none


@dataclass
class SamplingMetadata:
    num_reqs: int
    all_greedy: bool
    all_random: bool

    # ---- sampling (random rows) -------------------------------------------
    temperature: torch.Tensor | None = None  # [R] f32; greedy rows hold 1.0; None if all greedy
    is_greedy: torch.Tensor | None = None    # [R] bool; None if all greedy or all random
    top_k: torch.Tensor | None = None        # [R] int64; vocab_size = off
    top_p: torch.Tensor | None = None        # [R] f32; 1.0 = off
    min_p: torch.Tensor | None = None        # [R] f32; 0.0 = off
    # rows (random, not discarded) that draw from their own generator
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # the engine's generator for the other random rows (None: torch's default generator)
    default_generator: torch.Generator | None = None

    # ---- logprobs ---------------------------------------------------------
    max_num_logprobs: int | None = None      # k of this step (full vocab mapped to vocab_size)
    num_logprobs: np.ndarray | None = None   # [R] int32 host, per-row k (-1: none)

    # what the logprobs hold (the engine's `logprobs_mode`): raw_logprobs, raw_logits,
    # processed_logprobs or processed_logits
    logprobs_mode: str = "raw_logprobs"

    # ---- logits processors ------------------------------------------------
    # per-request Python callables (SamplingParams.logits_processors), rows that have
    # some: (batch row, [(fn, takes_prompt)], prompt token ids, output token ids so far)
    logits_processors: list[tuple[int, list[tuple[Callable, bool]], tuple[int, ...], list[int]]] | None = None
    # filled by the sampler: batch row -> error, rows whose own logits processor
    # raised (their row is sampled unprocessed; the engine fails those requests alone)
    failed_rows: dict[int, str] = field(default_factory=dict)
    allowed_token_ids_mask: torch.Tensor | None = None  # [R, V] bool, True = masked
    bad_words_rows: torch.Tensor | None = None          # [P] int64 } (row, token) pairs
    bad_words_ids: torch.Tensor | None = None           # [P] int64 } to set to -inf
    logit_bias_rows: torch.Tensor | None = None         # [B] int64
    logit_bias_ids: torch.Tensor | None = None          # [B] int64
    logit_bias_values: torch.Tensor | None = None       # [B] f32
    min_tokens_rows: torch.Tensor | None = None         # [M] int64 } stop/EOS ids masked
    min_tokens_ids: torch.Tensor | None = None          # [M] int64 } until min_tokens reached

    # ---- structured outputs (rows whose request has a grammar) -----------------
    grammar_bitmask: torch.Tensor | None = None         # [G, ceil(V/32)] int32, bit set = allowed
    grammar_rows: torch.Tensor | None = None            # [G] int64 batch rows (None: row i is row i)

    # ---- penalties (only rows that have one) --------------------------------
    penalty_rows: torch.Tensor | None = None            # [Rp] int64
    presence_penalties: torch.Tensor | None = None      # [Rp] f32
    frequency_penalties: torch.Tensor | None = None     # [Rp] f32
    repetition_penalties: torch.Tensor | None = None    # [Rp] f32
    prompt_token_mask: torch.Tensor | None = None       # [Rp, V] bool: token in the prompt
    output_token_counts: torch.Tensor | None = None     # [Rp, V] int32: count in the output

    # ---- host view ------------------------------------------------------------
    # builds the rows' parameters as host arrays on demand (static-shape samplers)
    host_rows: Callable[[], HostSamplingRows] | None = None
