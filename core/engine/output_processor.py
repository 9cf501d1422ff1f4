"""Turn per-step token updates into `RequestOutput`s: detokenization, stop
strings, logprobs, and fan-in of `n > 1` sibling requests."""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrunner.engine.detokenizer import IncrementalDetokenizer, TokenDecoder, decode_token
from polyrunner.engine.request import Request, RequestStatus
from polyrunner.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


@dataclass
class _Completion:
    request: Request
    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    tokenizer: TokenDecoder | None = None   # decodes Logprob.decoded_token; None with detokenize=False


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[str]
    stream: bool = False   # emit every step (else only when finished)
    tokenizer: TokenDecoder | None = None   # for prompt logprobs' decoded tokens (None: detokenize=False)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: set[str] = field(default_factory=set)


class OutputProcessor:
    def __init__(self, tokenizer: TokenDecoder | None) -> None:
        self.tokenizer = tokenizer
        self._completions: dict[str, _Completion] = {}
        self._parents: dict[str, _Parent] = {}
        self._parent_of: dict[str, str] = {}
        self.streaming: set[str] = set()   # child ids whose parent streams
        # child ids that need `update` or `output` every step (detokenize, logprobs or
        # streaming); the others need nothing until they finish
        self.watched: set[str] = set()

    def add(self, parent_id: str, children: list[Request], stream: bool = False) -> None:
        first = children[0]
        # vLLM: detokenize=False leaves the text empty and every Logprob.decoded_token None
        decoder = self.tokenizer if first.params.detokenize else None
        # the first prompt position has no logprob: a one-token prompt reports [None] (vLLM)
        self._parents[parent_id] = _Parent(parent_id, first.prompt, first.prompt_token_ids,
                                           [c.request_id for c in children], stream, tokenizer=decoder,
                                           prompt_logprobs=None if first.params.prompt_logprobs is None else [None])
        if stream:
            self.streaming.update(c.request_id for c in children)
        for i, req in enumerate(children):
            p = req.params
            detok = None
            if self.tokenizer is not None and p.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                    stop=p.stop or (), include_stop_str_in_output=p.include_stop_str_in_output)
            want_lp = p.logprobs is not None
            self._completions[req.request_id] = _Completion(req, i, detok, [] if want_lp else None,
                                                            0.0 if want_lp else None, decoder)
            if stream or detok is not None or want_lp:
                self.watched.add(req.request_id)
            self._parent_of[req.request_id] = parent_id

    def add_prompt_logprobs(self, req_id: str, rows: list[tuple[list[int], list[float], int]]) -> None:
        """Append a chunk of prompt logprobs (the first prompt position has none)."""
        parent = self._parents[self._parent_of[req_id]]
        if req_id != parent.children[0]:
            return  # siblings share the prompt
        assert parent.prompt_logprobs is not None   # rows come only for requests that asked for them
        parent.prompt_logprobs.extend(self.make_logprobs(*row, tokenizer=parent.tokenizer) for row in rows)

    def update(self, req: Request, new_ids: list[int],
               logprobs: tuple[list[int], list[float], int] | None) -> str | None:
        """Record new tokens of one request; returns a stop string that matched.
        A no-op for requests not in `watched`."""
        c = self._completions[req.request_id]
        if c.logprobs is not None and c.cumulative_logprob is not None and logprobs is not None:   # set together
            c.logprobs.append(self.make_logprobs(*logprobs, tokenizer=c.tokenizer))
            c.cumulative_logprob += logprobs[1][0]
        if c.detok is None:
            return None
        params = req.params
        if req.status == RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output:
            new_ids = new_ids[:-1]  # vLLM: the text of the stop token (EOS, stop_token_ids) is left out
        # vLLM: stop strings count only once the output has more than min_tokens tokens
        return c.detok.update(new_ids, check_stop=len(req.output_token_ids) > params.min_tokens)

    def process(self, advanced: list[Request],
                logprobs: dict[str, tuple[list[int], list[float], int]],
                num_new: list[int] | None = None) -> list[tuple[Request, str, int]]:
        """Record this step's token of each advanced request (detokenize, logprobs);
        returns (request, stop string, output tokens to keep) for each request whose text
        hit a stop string (the scheduler finishes it: `Scheduler.stop_at`).
        `num_new`: tokens each advanced request got this step (None: one each)."""
        hits: list[tuple[Request, str, int]] = []
        watched = self.watched
        if not watched:
            return hits
        for i, req in enumerate(advanced):
            rid = req.request_id
            if rid in watched:
                n = 1 if num_new is None else num_new[i]
                if not n:
                    continue
                new = req.output_token_ids[-n:]
                hit = self._stop_before_last(req, new) if n > 1 and req.params.stop else None
                if hit is None:
                    stop = self.update(req, new, logprobs.get(rid))
                    hit = None if stop is None else (stop, len(req.output_token_ids))
                if hit is not None:
                    hits.append((req, *hit))
        return hits

    def _stop_before_last(self, req: Request, new: list[int]) -> tuple[str, int] | None:
        """Several new tokens (speculative decoding): detokenize all but the last one by
        one; a stop string completed by one of them ends the output there: returns it and
        the output tokens up to it (the later ones are dropped, as without speculation).
        Else leaves only the last in `new` for `update`."""
        c = self._completions[req.request_id]
        if c.detok is None:
            return None
        outputs, n = req.output_token_ids, len(new)
        for j in range(n - 1):
            after = n - 1 - j   # tokens after this one
            stop = c.detok.update(new[j:j + 1], check_stop=len(outputs) - after > req.params.min_tokens)
            if stop is not None:
                return stop, len(outputs) - after
        new[:] = new[-1:]
        return None

    def outputs_for(self, advanced: list[Request], finished: list[Request]) -> list[RequestOutput]:
        """The outputs this step owes: every streaming parent that advanced, and
        every other parent whose children have all finished."""
        touched: dict[str, None] = {}
        for req in advanced if self.streaming else finished:
            if req.finished or req.request_id in self.streaming:
                touched[self._parent_of[req.request_id]] = None
        return [self.output(pid) for pid in touched if self.wants_output(pid)]

    @staticmethod
    def make_logprobs(token_ids: list[int], logprobs: list[float], rank: int,
                      tokenizer: TokenDecoder | None = None) -> PositionLogprobs:
        """First entry is the sampled (or actual) token with its rank; the rest are top-k.
        `tokenizer`: decodes each token's text (None: `decoded_token` stays None)."""
        entry: PositionLogprobs = {}
        for j, (tid, lp) in enumerate(zip(token_ids, logprobs)):
            if tid in entry:
                continue
            entry[tid] = Logprob(lp, rank if j == 0 else j,
                                 decode_token(tokenizer, tid) if tokenizer is not None else None)
        return entry

    def output(self, parent_id: str) -> RequestOutput:
        """The output of a parent request so far; forgets it once every child finished."""
        parent = self._parents[parent_id]
        outs = []
        for child_id in parent.children:
            c = self._completions[child_id]
            req = c.request
            finished = req.status.finished
            text = ""
            if c.detok is not None:
                if finished:
                    c.detok.flush()
                text = c.detok.text
            outs.append(CompletionOutput(
                index=c.index, text=text, token_ids=list(req.output_token_ids),
                finish_reason=req.status.value if finished else None,
                stop_reason=req.stop_reason,
                logprobs=None if c.logprobs is None else list(c.logprobs),  # a streamed output must not grow later
                cumulative_logprob=c.cumulative_logprob))
        done = all(o.finished() for o in outs)
        first = self._completions[parent.children[0]].request
        errors = [self._completions[c].request.error for c in parent.children]
        out = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, parent.prompt_logprobs,
                            outs, done, num_cached_tokens=first.num_cached_tokens,
                            error=next((e for e in errors if e), None), lora_request=first.lora_request)
        if done:
            self.drop(parent_id)
        return out

    def drop(self, parent_id: str) -> None:
        parent = self._parents.get(parent_id)
        if parent is None:
            return
        for child_id in parent.children:
            self.streaming.discard(child_id)
            self.watched.discard(child_id)
            self._completions.pop(child_id, None)
            self._parent_of.pop(child_id, None)
        self._parents.pop(parent.request_id, None)

    def parent_id(self, req_id: str) -> str | None:
        return self._parent_of.get(req_id)

    def wants_output(self, parent_id: str) -> bool:
        """Streaming parents report every step; others only once all children finished."""
        parent = self._parents[parent_id]
        return parent.stream or all(self._completions[c].request.finished for c in parent.children)

    def children(self, parent_id: str) -> list[str]:
        p = self._parents.get(parent_id)
        return list(p.children) if p else []
