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
