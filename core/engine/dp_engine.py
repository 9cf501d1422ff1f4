"""Offline data parallelism: what `LLM` needs of an `LLMEngine` (add_request, step,
has_requests, abort_request, tokenizer, arch, max_model_len, shutdown), served by
`DPCores` — N engine processes, requests spread by the same router as the server's.

`step()` waits for the next report of any replica and returns its outputs (every
output of a `stream=True` request, the finished ones of the others), so `LLM`'s
loops (generate with tqdm, generate_stream, beam search, chat) run unchanged and
return outputs in prompt order. Unlike one engine, an invalid prompt is found in
its replica, after `add_request` returned: it comes back as a finished output with
`error` set (finish_reason "error"), never as a ValueError from `add_request`.
"""

from __future__ import annotations

import itertools
import queue
from typing import TYPE_CHECKING, Any

from polyrunner.engine.core_errors import EngineDeadError
from polyrunner.engine.dp_cores import DPCores
from polyrunner.engine.engine_loop import CoreCounts, Event
from polyrunner.engine.engine_process import MakeEngine
from polyrunner.outputs import CompletionOutput, RequestOutput
from polyrunner.prompt import Prompt
from polyrunner.sampling_params import SamplingParams

if TYPE_CHECKING:
    from polyrunner.engine.tokenizer import Tokenizer
    from polyrunner.lora.request import LoRARequest
    from polyrunner.models.arch import DecoderArch


class DPEngine:
    """`size` replicas of `LLM(**llm_kwargs)` behind an `LLMEngine`-like face."""

    def __init__(self, llm_kwargs: dict[str, Any], size: int, make_engine: MakeEngine,
                 routing: str = "least_loaded") -> None:
        self._reports: queue.SimpleQueue[list[Event] | BaseException] = queue.SimpleQueue()
        self.cores = DPCores(llm_kwargs, size, self._on_report, self._reports.put, make_engine, routing)
        info = self.cores.info
        self.tokenizer: Tokenizer | None = info.tokenizer
        self.max_model_len = info.max_model_len
        assert info.arch is not None
        self.arch: DecoderArch = info.arch
        self._ids = itertools.count()
        self._pending: dict[str, tuple[Prompt, bool]] = {}   # unfinished: prompt, stream

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    stream: bool = False, priority: int = 0, *, lora_request: LoRARequest | None = None) -> str:
        """Queue a request on the router's replica; returns its id."""
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self._pending:
            raise ValueError(f"request_id {rid!r} is already in use")
        self._pending[rid] = (prompt, stream)
        self.cores.submit([("add", rid, prompt, params or SamplingParams(), priority, lora_request)])
        return rid

    def has_requests(self) -> bool:
        return bool(self._pending)

    def abort_request(self, request_id: str) -> None:
        if self._pending.pop(request_id, None) is not None:
            self.cores.submit([("abort", request_id)])

    def step(self) -> list[RequestOutput]:
        """Wait for the replicas' next reports; their outputs (see the module docstring)."""
        if not self._pending:
            return []
        reports = [self._reports.get()]
        while not self._reports.empty():
            reports.append(self._reports.get())
        outs: list[RequestOutput] = []
        for report in reports:
            if isinstance(report, BaseException):
                raise EngineDeadError(f"the data-parallel engine died: {report}") from report
            for event in report:
                outs.extend(self._outputs(event))
        return outs

    def _outputs(self, event: Event) -> list[RequestOutput]:
        if event[0] == "outputs":
            outs = []
            for out in event[1]:
                known = self._pending.get(out.request_id)
                if known is None:
                    continue
                if out.finished:
                    del self._pending[out.request_id]
                if out.finished or known[1]:
                    outs.append(out)
            return outs
        if event[0] in ("rejected", "failed") and event[1] in self._pending:
            prompt, _ = self._pending.pop(event[1])
            error = event[2][1] if event[0] == "rejected" else str(event[2])
            return [_error_output(event[1], prompt, error)]
        return []   # "aborted": the caller dropped it already

    def shutdown(self) -> None:
        self.cores.stop()

    def _on_report(self, events: list[Event], counts: CoreCounts, replica: int | None) -> None:
        if events:
            self._reports.put(events)


def _error_output(rid: str, prompt: Prompt, error: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
    given = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    ids = list(given) if isinstance(given, (list, tuple)) else []
    return RequestOutput(rid, text, ids, outputs=[CompletionOutput(0, "", [], finish_reason="error")],
                         finished=True, error=error)
