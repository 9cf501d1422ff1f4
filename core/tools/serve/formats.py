"""OpenAI response and stream formats: cumulative outputs -> choices, deltas,
server-sent events ending with `data: [DONE]`, usage."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from polyrunner.outputs import CompletionOutput
from polyrunner.tools.serve import protocol as P
from polyrunner.tools.serve.calls import Call, Event

logger = logging.getLogger(__name__)


def sse(call: Call, chunks: AsyncIterator[str]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:   # the engine died or refused mid-stream, the server is stopping: tell the
            err = exc              # client (an error event, then [DONE]) and end cleanly
            if not isinstance(err, P.RequestError):
                logger.exception("stream failed")
                err = P.RequestError(f"{type(exc).__name__}: {exc}", status=500, type="server_error")
            yield f"data: {err.response().model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            call.abort()
            call.close()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse_data(model: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {model.model_dump_json(exclude=exclude)}\n\n"


def usage(call: Call) -> P.UsageInfo:
    prompt = sum(len(p["prompt_token_ids"]) for p in call.prompts)
    completion = sum(len(c.token_ids) for out in call.latest if out is not None for c in out.outputs)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class Format:
    """Turns cumulative outputs into OpenAI choices and stream deltas."""

    def __init__(self, tokenizer, call: Call, req: P._SamplingRequest, model: str) -> None:
        self.call = call
        self.req = req
        self.model = model
        self.tok = tokenizer
        self.n = req.n
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # a chunk without new text still matters when it carries logprobs or token ids
        self.wants_tokens = bool(req.logprobs is not None and req.logprobs is not False) or req.return_token_ids
        # per choice: text and token count already sent, finished sent
        self._sent: dict[int, tuple[int, int, bool]] = {}

    def token_str(self, tid: int, lp) -> str:
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{tid}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None else f"token_id:{tid}"

    def deltas(self, event: Event) -> list[tuple[int, CompletionOutput, str, int, bool]]:
        """(choice index, completion, new text, first new token, first chunk) for each
        completion with something new since the last call."""
        out = []
        for c in event.output.outputs:
            index = event.index * self.n + c.index
            text_len, n_tokens, done = self._sent.get(index, (0, 0, False))
            first = index not in self._sent
            if done:
                continue
            new_text = c.text[text_len:]
            new_tokens = self.wants_tokens and len(c.token_ids) > n_tokens
            if not (new_text or new_tokens or c.finished() or first):
                continue
            self._sent[index] = (len(c.text), len(c.token_ids), c.finished())
            out.append((index, c, new_text, n_tokens, first))
        return out

    def usage_chunk(self, cls) -> str:
        return sse_data(cls(id=self.call.id, created=self.call.created, model=self.model, choices=[],
                         usage=usage(self.call)))


class CompletionFormat(Format):
    req: P.CompletionRequest

    def logprobs(self, c: CompletionOutput, start: int, offset: int) -> P.CompletionLogProbs | None:
        if c.logprobs is None:
            return None
        lp = P.CompletionLogProbs()
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            chosen = entry.get(tid)
            s = self.token_str(tid, chosen)
            lp.tokens.append(s)
            lp.token_logprobs.append(chosen.logprob if chosen is not None else None)
            lp.top_logprobs.append({self.token_str(t, x): max(x.logprob, -9999.0) for t, x in entry.items()})
            lp.text_offset.append(offset)
            offset += len(s)
        return lp

    def choice(self, index: int, c: CompletionOutput, text: str, start: int, prompt: dict, first: bool,
               offset: int) -> P.CompletionChoice:
        ids = self.req.return_token_ids
        return P.CompletionChoice(
            index=index, text=text, logprobs=self.logprobs(c, start, offset), finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, token_ids=c.token_ids[start:] if ids else None,
            prompt_token_ids=prompt["prompt_token_ids"] if ids and first else None)

    def _echo(self, prompt: dict) -> str:
        if not self.req.echo:
            return ""
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        return self.tok.decode(prompt["prompt_token_ids"]) if self.tok is not None else ""

    def response(self) -> P.CompletionResponse:
        choices = []
        for i, out in enumerate(self.call.latest):
            prompt = self.call.prompts[i]
            echo = self._echo(prompt)
            for c in out.outputs:
                choices.append(self.choice(i * self.n + c.index, c, echo + c.text, 0, prompt, True, len(echo)))
        return P.CompletionResponse(id=self.call.id, created=self.call.created, model=self.model,
                                    choices=choices, usage=usage(self.call))

    async def stream(self) -> AsyncIterator[str]:
        exclude = None if self.include_usage else {"usage"}
        async for event in self.call.events():
            prompt = self.call.prompts[event.index]
            choices = []
            for index, c, text, start, first in self.deltas(event):
                echo = self._echo(prompt) if first else ""
                offset = len(c.text) - len(text)
                choices.append(self.choice(index, c, echo + text, start, prompt, first, offset))
            if choices:
                yield sse_data(P.CompletionChunk(id=self.call.id, created=self.call.created, model=self.model,
                                              choices=choices), exclude)
        if self.include_usage:
            yield self.usage_chunk(P.CompletionChunk)
        yield "data: [DONE]\n\n"


class ChatFormat(Format):
    req: P.ChatCompletionRequest

    def logprobs(self, c: CompletionOutput, start: int) -> P.ChatLogProbs | None:
        if c.logprobs is None:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            chosen = entry.get(tid)
            s = self.token_str(tid, chosen)
            top = sorted(((t, x) for t, x in entry.items() if x.rank is not None and x.rank <= k),
                         key=lambda tx: tx[1].rank)[:k]
            content.append(P.TokenLogprob(
                token=s, logprob=max(chosen.logprob, -9999.0) if chosen else -9999.0, bytes=list(s.encode()),
                top_logprobs=[P.TopLogprob(token=(ts := self.token_str(t, x)), logprob=max(x.logprob, -9999.0),
                                           bytes=list(ts.encode())) for t, x in top]))
        return P.ChatLogProbs(content=content)

    def response(self) -> P.ChatCompletionResponse:
        out = self.call.latest[0]
        ids = self.req.return_token_ids
        choices = [P.ChatChoice(index=c.index, message=P.ChatMessageOut(content=c.text),
                                logprobs=self.logprobs(c, 0), finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason, token_ids=list(c.token_ids) if ids else None)
                   for c in out.outputs]
        return P.ChatCompletionResponse(id=self.call.id, created=self.call.created, model=self.model,
                                        choices=choices, usage=usage(self.call),
                                        prompt_token_ids=self.call.prompts[0]["prompt_token_ids"] if ids else None)

    async def stream(self) -> AsyncIterator[str]:
        exclude = None if self.include_usage else {"usage"}
        call, ids = self.call, self.req.return_token_ids

        def chunk(choices: list[P.ChatChunkChoice]) -> str:
            return sse_data(P.ChatCompletionChunk(id=call.id, created=call.created, model=self.model,
                                               choices=choices), exclude)

        # the first chunk of every choice carries the role (OpenAI), no content yet
        yield chunk([P.ChatChunkChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                     for i in range(self.n)])
        async for event in call.events():
            choices = []
            for index, c, text, start, _ in self.deltas(event):
                choices.append(P.ChatChunkChoice(
                    index=index, delta=P.DeltaMessage(content=text), logprobs=self.logprobs(c, start),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason if c.finished() else None,
                    token_ids=c.token_ids[start:] if ids else None))
            if choices:
                yield chunk(choices)
        if self.include_usage:
            yield self.usage_chunk(P.ChatCompletionChunk)
        yield "data: [DONE]\n\n"
