"""What the runner returns for one step, by batch row of the scheduler output."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

LogprobRow = tuple[list[int], list[float], int]   # token ids, logprobs, rank of the first


@dataclass
class ModelRunnerOutput:
    """One step's results, by batch row of the scheduler output."""

    tokens: np.ndarray                                   # [R] int64; rows that ran a partial prefill: ignore
    logprobs: dict[str, LogprobRow] = field(default_factory=dict)               # req_id -> sampled token's
    prompt_logprobs: dict[str, list[LogprobRow]] = field(default_factory=dict)  # req_id -> this step's chunk
    errors: dict[int, str] = field(default_factory=dict)  # batch row -> why its request failed (own code)
    # speculative decoding (None without it): [R, k + 1] tokens per row, -1 after the
    # first num_sampled[i] (accepted drafts, then the sampled token); the drafts proposed
    # for each row's next step, [R, k] and their counts [R]
    sampled_token_ids: np.ndarray | None = None
    num_sampled: np.ndarray | None = None
    draft_token_ids: np.ndarray | None = None
    num_draft_tokens: np.ndarray | None = None
