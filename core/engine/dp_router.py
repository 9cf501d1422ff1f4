"""Which data-parallel replica serves a new request.

Two policies (`routing`):

- "least_loaded" (the default; vLLM's DP balancing): the live replica with the
  fewest requests in hand — running + waiting from its latest report, plus the
  requests routed to it that it had not taken yet (the caller folds both into
  `loads`). Ties go round: the first tied replica after the one chosen last
  (so light, one-at-a-time traffic still uses every replica).
- "cache_aware" (the name vLLM's router gives prefix-cache affinity): the live
  replica picked by a hash of the prompt's first block of tokens (the first
  `block_size` ids; a text prompt without ids: its first 4 * `block_size`
  characters), so repeated prompts reach the replica whose prefix cache holds
  them; when that replica is much busier than the least loaded one (more than
  `balance_abs_threshold` requests more AND more than `balance_rel_threshold`
  times as many) the least loaded one serves instead.

Dead replicas are never chosen; with none alive `choose` raises `NoReplicaError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

from polyrunner.prompt import Prompt

Routing = Literal["least_loaded", "cache_aware"]
ROUTINGS: tuple[str, ...] = get_args(Routing)


class NoReplicaError(RuntimeError):
    """Every replica is dead."""


def prefix_key(prompt: Prompt | None, block_size: int) -> int | None:
    """A hash of the prompt's first block (token ids when given, else text); None: nothing to hash."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        if ids:
            return hash(tuple(ids[:block_size]))
        prompt = prompt.get("prompt")
    if isinstance(prompt, str) and prompt:
        return hash(prompt[:4 * block_size])
    return None


class Router:
    """Picks a replica for each new request (see the module docstring)."""

    def __init__(self, routing: str = "least_loaded", block_size: int = 16,
                 balance_abs_threshold: int = 16, balance_rel_threshold: float = 1.5) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r} is not supported; allowed: {', '.join(ROUTINGS)}")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1.0, got "
                             f"{balance_abs_threshold} and {balance_rel_threshold}")
        self.routing = routing
        self.block_size = block_size
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self._last = -1   # the replica chosen last (for ties)

    def choose(self, loads: Sequence[int], alive: Sequence[bool], prompt: Prompt | None = None) -> int:
        """The index of the replica for a request with `prompt`, given each replica's load
        and whether it is alive (same length)."""
        live = [i for i, ok in enumerate(alive) if ok]
        if not live:
            raise NoReplicaError("every data-parallel replica is dead")
        least = min(loads[i] for i in live)
        tied = [i for i in live if loads[i] == least]
        best = next((i for i in tied if i > self._last), tied[0])
        if self.routing == "cache_aware":
            best = self._home(best, loads, live, prompt)
        self._last = best
        return best

    def _home(self, best: int, loads: Sequence[int], live: list[int], prompt: Prompt | None) -> int:
        """The prompt's replica by its first block, unless it is much busier than `best`."""
        key = prefix_key(prompt, self.block_size)
        if key is None:
            return best
        home = live[key % len(live)]
        busy, least = loads[home], loads[best]
        if busy - least > self.abs_threshold and busy > self.rel_threshold * least:
            return best
        return home
