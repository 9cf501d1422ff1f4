"""Static-shape sampling over padded request rows.

Every tensor here has `R_pad` rows (a request bucket), so each piece compiles
once per bucket: the all-greedy graph (min_tokens mask + argmax), the random
graph (mask, temperature, top-k, top-p, min-p, then argmax(probs / q)), and
the logprob graph (log_softmax + top-K, with K fixed). The functions are plain
torch and run unchanged on the host for the rare step the graphs cannot take
(see `SamplingInputs.host_only`).

Randomness is counter-based, not a device RNG: row r's noise over the
vocabulary is a hash of (key_r, token id), where key_r mixes the request's
seed with the index of the output token being sampled. A seeded request thus
samples the same tokens whatever else is in the batch, after preemption, and
on either path; unseeded rows get a fresh key from the engine-seeded host RNG.

Unsupported on the device (declared in the backend's capabilities, so the
engine rejects such requests): penalties, logit_bias, allowed_token_ids,
bad_words, prompt_logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from polyrunner.backends.xla import envs
from polyrunner.plugin_api import (
    HostSamplingRows,
    LogprobsLists,
    LogprobsTensors,
    apply_min_p,
    apply_top_k_top_p,
    compute_logprobs,
    gather_logprobs,
)

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
STOP_WIDTH = envs.STOP_WIDTH.get()       # min_tokens stop ids per row
MAX_LOGPROBS = envs.MAX_LOGPROBS.get()   # K of the logprob graph


# ---- counter-based noise ----------------------------------------------------
def mix32(x):
    """A 32-bit integer finaliser (lowbias32); works on numpy uint64/int64 and torch int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def row_keys(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Host: one 32-bit key per row from a 64-bit seed and the output index."""
    seeds = seeds.astype(np.uint64)
    lo, hi = seeds & np.uint64(MASK32), seeds >> np.uint64(32)
    c = mix32(counters.astype(np.uint64) & np.uint64(MASK32))
    return mix32(lo ^ mix32(hi ^ c)).astype(np.int64)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[R, V]` Exp(1) noise, a pure function of (key, token id); never 0."""
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    h = mix32((keys.unsqueeze(1) + ids.unsqueeze(0) * GOLDEN) & MASK32)
    h = mix32(h ^ keys.unsqueeze(1))
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


# ---- the graphs (plain torch, static shapes) ---------------------------------
def mask_stop_ids(logits: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """-inf at `stop_ids` `[R, S]` (value V = unused slot): min_tokens not reached yet."""
    rows, vocab = logits.shape
    hit = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
    hit = hit.scatter(1, stop_ids, True)[:, :vocab]
    return logits.masked_fill(hit, float("-inf"))


def sample_greedy(logits: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    return mask_stop_ids(logits, stop_ids).argmax(dim=-1)


def sample_random(logits: torch.Tensor, stop_ids: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  is_greedy: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    logits = mask_stop_ids(logits, stop_ids)
    greedy = logits.argmax(dim=-1)
    scaled = apply_top_k_top_p(logits / temperature.unsqueeze(1), top_k, top_p)
    probs = apply_min_p(torch.softmax(scaled, dim=-1), min_p)
    sampled = probs.div(exponential_noise(keys, logits.shape[1])).argmax(dim=-1)
    return torch.where(is_greedy, greedy, sampled)


def topk_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> LogprobsTensors:
    """Raw logprobs of `tokens` plus the top-k, k fixed (one graph per bucket)."""
    return gather_logprobs(compute_logprobs(logits), k, tokens)


# ---- host side ------------------------------------------------------------------
@dataclass
class SamplingInputs:
    """Padded host arrays for one step's rows (`R_pad` rows, padding = greedy no-ops)."""

    all_greedy: bool
    stop_ids: np.ndarray      # [R_pad, S] int64 (V = unused)
    temperature: np.ndarray   # [R_pad] f32
    top_k: np.ndarray         # [R_pad] int64
    top_p: np.ndarray         # [R_pad] f32
    min_p: np.ndarray         # [R_pad] f32
    is_greedy: np.ndarray     # [R_pad] bool
    keys: np.ndarray          # [R_pad] int64
    num_logprobs: np.ndarray  # [R] int64, -1 = none
    max_logprobs: int         # -1 = no row wants logprobs
    host_only: bool           # a row needs more than the graphs hold (stop ids / logprobs)

    def random_args(self) -> tuple[np.ndarray, ...]:
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.is_greedy, self.keys)


def build_sampling_inputs(rows: HostSamplingRows, padded_rows: int, vocab: int,
                          rng: np.random.Generator, stop_width: int = STOP_WIDTH,
                          max_logprobs: int = MAX_LOGPROBS) -> SamplingInputs:
    """The step's rows (`SamplingMetadata.host_rows()`) as arrays padded to `padded_rows`."""
    n = len(rows.greedy)
    R = max(padded_rows, n)

    def padded(values: np.ndarray, fill, dtype) -> np.ndarray:
        out = np.full(R, fill, dtype)
        out[:n] = values
        return out

    is_greedy = padded(rows.greedy, True, bool)
    temperature = padded(rows.temperature, 1.0, np.float32)
    top_k = padded(rows.top_k, vocab, np.int64)
    top_p = padded(rows.top_p, 1.0, np.float32)
    min_p = padded(rows.min_p, 0.0, np.float32)
    keys = np.zeros(R, np.int64)
    all_greedy = bool(rows.greedy.all())
    if not all_greedy:
        seeds = rng.integers(0, 1 << 62, size=n, dtype=np.int64).astype(np.uint64)
        seeds[rows.seeded] = rows.seed[rows.seeded]
        keys[:n] = row_keys(seeds, rows.num_output_tokens)

    active = [i for i in np.flatnonzero(rows.num_output_tokens < rows.min_tokens).tolist()
              if rows.stop_ids[i] is not None]
    width = max([stop_width] + [len(rows.stop_ids[i]) for i in active])
    stop_ids = np.full((R, width), vocab, np.int64)
    for i in active:
        ids = rows.stop_ids[i]
        stop_ids[i, :len(ids)] = ids

    num_logprobs = rows.num_logprobs.copy()
    max_lp = int(num_logprobs.max()) if n else -1
    host_only = width > stop_width or max_lp > min(max_logprobs, vocab)
    return SamplingInputs(all_greedy, stop_ids, temperature, top_k, top_p, min_p, is_greedy,
                          keys, num_logprobs, max_lp, host_only)


@dataclass
class RowLogprobs(LogprobsTensors):
    """Logprobs of a padded step with a fixed top-k; `tolists` keeps each row's own k."""

    num_logprobs: np.ndarray | None = None  # [rows] per-row k (-1: none)

    def tolists(self) -> LogprobsLists:
        full = super().tolists()
        if self.num_logprobs is None:
            return full
        n = len(self.num_logprobs)
        ends = [max(int(k), 0) + 1 for k in self.num_logprobs]
        return LogprobsLists([ids[:e] for ids, e in zip(full.token_ids[:n], ends)],
                             [lp[:e] for lp, e in zip(full.logprobs[:n], ends)], full.ranks[:n])
