"""What the engine reports for metrics: per-request timings and per-step stats
(built in the core's report thread by `AsyncLLM`, read by stats listeners such
as the server's Prometheus metrics)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RequestTimings:
    """When things happened to one request (time.monotonic seconds)."""

    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # one entry per step that produced tokens
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    finish_reason: str | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class StepStats:
    """What one engine step did, for metrics (built in the engine thread)."""

    num_running: int
    num_waiting: int
    num_preemptions: int                      # preemptions in this step
    num_prompt_tokens: int = 0                # prompts of requests that got their first token
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[RequestTimings] = field(default_factory=list)
    replica: int | None = None                # the data-parallel replica that reported (None: one core)


StatsListener = Callable[[StepStats], None]
