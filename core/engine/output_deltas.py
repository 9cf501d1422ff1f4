"""The wire format of outputs between an engine process and its frontend.

The engine produces cumulative `RequestOutput`s (all text, token ids and
logprobs so far). Sending those every step would cost O(length) per token, so
the engine side sends only what changed (`DeltaEncoder`) and the frontend
rebuilds the cumulative outputs (`DeltaDecoder`). Token ids, logprobs and
prompt logprobs only ever grow; text usually grows but can shrink at the end
(a stop string found across tokens is cut off), so a text delta is
"keep the first `keep` characters, then append `add`".

A delta is a plain tuple (cheap to pickle):
    (request_id, head, finished, num_cached_tokens, error, prompt_logprobs_added, completions)
where `head` is (prompt, prompt_token_ids) in a request's first delta, else None,
and each completion is
    (index, keep, add, token_ids_added, finish_reason, stop_reason, logprobs_added, cumulative_logprob).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from polyrunner.outputs import CompletionOutput, PositionLogprobs, RequestOutput

Delta: TypeAlias = tuple[Any, ...]


@dataclass
class _Sent:
    """What the frontend already has of one request (engine side)."""

    prompt_logprobs: int = 0
    completions: dict[int, tuple[str, int, int]] = field(default_factory=dict)   # text, tokens, logprobs


class DeltaEncoder:
    """Engine side: cumulative outputs in, deltas out. Forgets a request once it finished."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, outs: list[RequestOutput]) -> list[Delta]:
        return [self._encode(out) for out in outs]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)

    def _encode(self, out: RequestOutput) -> Delta:
        sent = self._sent.get(out.request_id)
        head = None
        if sent is None:
            sent = self._sent[out.request_id] = _Sent()
            head = (out.prompt, out.prompt_token_ids)
        plp = out.prompt_logprobs
        plp_added = None
        if plp is not None and len(plp) > sent.prompt_logprobs:
            plp_added = plp[sent.prompt_logprobs:]
            sent.prompt_logprobs = len(plp)
        comps = []
        for c in out.outputs:
            text, n_tok, n_lp = sent.completions.get(c.index, ("", 0, 0))
            keep = len(text) if c.text.startswith(text) else len(os.path.commonprefix([text, c.text]))
            lps = c.logprobs
            comps.append((c.index, keep, c.text[keep:], c.token_ids[n_tok:], c.finish_reason, c.stop_reason,
                          None if lps is None else lps[n_lp:], c.cumulative_logprob))
            sent.completions[c.index] = (c.text, len(c.token_ids), 0 if lps is None else len(lps))
        if out.finished:
            del self._sent[out.request_id]
        return (out.request_id, head, out.finished, out.num_cached_tokens, out.error, plp_added, comps)


@dataclass
class _Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    completions: dict[int, _Completion] = field(default_factory=dict)


class DeltaDecoder:
    """Frontend side: deltas in, cumulative `RequestOutput`s out (each one a
    snapshot: later deltas never change an output already returned)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def decode(self, delta: Delta) -> RequestOutput:
        rid, head, finished, num_cached, error, plp_added, comps = delta
        req = self._requests.get(rid)
        if req is None:
            prompt, ids = head if head is not None else (None, [])
            req = self._requests[rid] = _Request(prompt, ids)
        if plp_added is not None:
            req.prompt_logprobs = (req.prompt_logprobs or []) + plp_added
        for index, keep, add, ids_added, finish, stop, lps_added, cum in comps:
            c = req.completions.get(index)
            if c is None:
                c = req.completions[index] = _Completion()
            c.text = (c.text if keep == len(c.text) else c.text[:keep]) + add
            c.token_ids.extend(ids_added)
            if lps_added is not None:
                c.logprobs = (c.logprobs or []) + lps_added
            c.finish_reason, c.stop_reason, c.cumulative_logprob = finish, stop, cum
        outputs = [CompletionOutput(i, c.text, list(c.token_ids), c.cumulative_logprob,
                                    None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason)
                   for i, c in sorted(req.completions.items())]
        if finished:
            del self._requests[rid]
        plp = None if req.prompt_logprobs is None else list(req.prompt_logprobs)
        return RequestOutput(rid, req.prompt, req.prompt_token_ids, plp, outputs, finished,
                             num_cached_tokens=num_cached, error=error)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)
