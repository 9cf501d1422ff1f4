"""A step whose sampled tokens are still on their way to the host (asynchronous
scheduling, after vLLM V1's `AsyncGPUModelRunnerOutput`).

When the runner queues step N it writes a placeholder (-1) where each sampled
token will go in its slot's token row, and keeps the device tensor of sampled
tokens. Step N+1, prepared before N's tokens reach the host, takes the input id
of every placeholder position from that device tensor (`feed_input_ids`); just
before N+1 samples, `resolve` waits for the copy and writes N's real tokens over
the placeholders, so the sampling metadata (penalties, bad words, logits
processors) sees exactly what a synchronous step would. A slot removed while
its step is in flight (finished one step late, or aborted) gets nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from polyrunner.device.backend import HostFuture
from polyrunner.step_channel import ModelRunnerOutput

if TYPE_CHECKING:
    from polyrunner.sample.logprobs import LogprobsFuture

PLACEHOLDER = -1   # a token id still on the device (real ids are >= 0)


class AsyncModelRunnerOutput:
    """One queued step. `get_output()` waits for its tokens and returns the step's
    `ModelRunnerOutput` (rows of removed slots keep their token in `tokens`, but
    the slot's state is not touched and their logprobs are left out)."""

    def __init__(self, future: HostFuture, sampled: torch.Tensor, slots: np.ndarray, kept: np.ndarray,
                 positions: np.ndarray, num_slots: int, token_ids: np.ndarray,
                 make_output: Callable[[np.ndarray], ModelRunnerOutput],
                 logprobs: "LogprobsFuture | None" = None,
                 logprob_rows: list[tuple[int, str, int]] | None = None) -> None:
        """`sampled`: the device tensor of sampled tokens (row i = batch row i);
        `slots`: batch row -> slot; `kept`: rows whose token counts (not a partial
        prefill), with its placeholder at `positions` of its slot's row of
        `token_ids`; `make_output(tokens)`: the step's output without logprobs (it waits
        for the prompt logprobs' copies); `logprobs`: the sampled logprobs' copies to the
        host, started when the step was queued; `logprob_rows`: (row, request id, number of
        logprobs) to report."""
        self.future = future
        self.sampled = sampled
        self.slots = slots
        self.kept = kept
        self.positions = positions
        self.live = np.ones(len(slots), bool)
        self.row_of_slot = np.full(num_slots, -1, np.int64)
        self.row_of_slot[slots[kept]] = kept
        self._token_ids = token_ids
        self._make_output = make_output
        self._logprobs = logprobs
        self._logprob_rows = logprob_rows or []
        self.tokens: np.ndarray | None = None

    @property
    def resolved(self) -> bool:
        return self.tokens is not None

    def drop_slots(self, slots: list[int]) -> None:
        """Those slots' requests left while the step was in flight: skip their rows."""
        if not self.resolved:
            self.live &= ~np.isin(self.slots, slots)
            self.row_of_slot[slots] = -1

    def resolve(self) -> np.ndarray:
        """Wait for the tokens; write them over the live rows' placeholders (once)."""
        if self.tokens is None:
            tokens = self.future.result().numpy()[:len(self.slots)].astype(np.int64, copy=False)
            rows, positions = self.kept, self.positions
            live = self.live[rows]
            if not live.all():
                rows, positions = rows[live], positions[live]
            self._token_ids[self.slots[rows], positions] = tokens[rows]
            self.tokens = tokens
        return self.tokens

    def get_output(self) -> ModelRunnerOutput:
        """The step's result (waits for its tokens and its logprobs' copies, once)."""
        tokens = self.resolve()
        result = self._make_output(tokens)
        if self._logprobs is not None:
            lists = self._logprobs.result()
            for row, req_id, k in self._logprob_rows:
                if self.live[row]:
                    result.logprobs[req_id] = lists.row(row, k)
        self._logprobs = None
        return result

    def feed_input_ids(self, input_ids: np.ndarray, num_tokens: int, token_to_req: np.ndarray,
                       slots: np.ndarray, to_device: Callable[[np.ndarray], torch.Tensor]
                       ) -> Callable[[torch.Tensor], None] | None:
        """For the next step's host `input_ids` (the first `num_tokens` are real; token
        t belongs to batch row `token_to_req[t]`, of slot `slots[row]`): zero the
        placeholders and return a function that writes this step's sampled tokens
        into the uploaded device ids at those places; None when there is none."""
        holes = np.flatnonzero(input_ids[:num_tokens] == PLACEHOLDER)
        if not holes.size:
            return None
        hole_slots = slots[token_to_req[holes]]
        src = self.row_of_slot[hole_slots]
        if (src < 0).any():
            raise RuntimeError("an input token is still on the device but no step in flight sampled it "
                               f"(slots {sorted(set(hole_slots[src < 0].tolist()))})")
        input_ids[holes] = 0
        dst_dev, src_dev = to_device(holes), to_device(src)
        sampled = self.sampled

        def write(ids: torch.Tensor) -> None:
            ids.index_copy_(0, dst_dev, sampled.index_select(0, src_dev).to(ids.dtype))
        return write
