"""Incremental detokenization and stop strings.

The engine samples one token (sometimes a few) per request per step and must
turn them into text as they arrive, for streaming and for stop strings. Doing
`tokenizer.decode(all_output_ids)` each step costs O(length) per step;
`IncrementalDetokenizer` instead decodes a small window and diffs (the
prefix/read-offset technique of HF TGI and vLLM):

    ids:  ... | prefix window | unread tokens |
              ^ prefix_offset ^ read_offset   ^ len(ids)

    prefix_text = decode(ids[prefix_offset:read_offset])   (cached)
    new_text    = decode(ids[prefix_offset:])
    new text of the unread tokens = new_text[len(prefix_text):]

Decoding the unread tokens together with a few already-emitted ones keeps
the spacing of the full decode: SentencePiece decoders drop the leading "▁"
space of the *first* token only, and here that first token is the window's,
in both decodes. The unread tokens are committed (emitted) only at a point
after which later tokens cannot change the text any more:

- not while the text ends with U+FFFD (an incomplete UTF-8 character, e.g.
  byte-level BPE pieces or `<0xE2>` `<0x82>` of a "€");
- not inside an open run of byte-fallback pieces (`<0xNN>`): the `tokenizers`
  ByteFallback decoder turns a WHOLE run into U+FFFDs when any byte of it is
  invalid, so a later invalid byte would rewrite a "€" already seen. Such a
  run is emitted once a non-byte token closes it (or at `flush()`);
- not before the unread tokens add text (a skipped special token alone must
  not become the start of the next window).

With these rules the emitted text is always a prefix of the full decode, and
after `flush()` it equals it exactly.

Stop strings are searched, each step, in the last `max_stop_len - 1`
committed characters plus the text of the unread tokens (the text as if the
request ended now), so a stop string spanning tokens is found at the step
that completes it. Streaming holds back a suffix that could still grow into a
stop string (unless the stop string is to be included in the output).

Engine use, per request::

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=params.stop, ...)
    each step:  stop_str = detok.update(new_token_ids)
                if stop_str is not None: finish the request (reason "stop")
                delta = detok.take_delta()          # streaming
    at finish:  delta = detok.flush()               # held-back text; idempotent
                final = detok.text
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "decode_token"]

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as left context for the first output tokens. A UTF-8
# character spans at most 4 tokens, so 5 always reach back to a character start.
_PROMPT_CONTEXT = 5


class TokenDecoder(Protocol):
    """What detokenizing needs of a tokenizer (polyrunner's Tokenizer has it)."""

    @property
    def all_special_ids(self) -> AbstractSet[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> Sequence[str | None]: ...


def _byte_piece(piece: str | None) -> int | None:
    """The byte of a byte-fallback piece such as "<0xE2>", else None."""
    if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return int(piece[3:5], 16)
        except ValueError:
            return None
    return None


def _as_ids(ids: Sequence[int]) -> list[int]:
    if hasattr(ids, "tolist"):  # numpy array / torch tensor
        ids = ids.tolist()
    return [int(i) for i in ids]


class IncrementalDetokenizer:
    """Detokenizes one request's output tokens as they arrive and watches stop strings.

    `tokenizer` needs `decode(ids, skip_special_tokens=...)`,
    `convert_ids_to_tokens(ids)` and `all_special_ids` (polyrunner's Tokenizer).

    `prompt_token_ids`: the last few are decoded as left context, so the output
    reads as the continuation of the prompt: with SentencePiece tokenizers a
    first output token "▁Paris" gives " Paris" (as in vLLM and TGI), whereas
    `decode(output_ids)` alone drops that space. Pass `()` to get exactly
    `decode(output_ids)`. Byte-level BPE tokenizers give the same either way.

    Text semantics: `text` (and the sum of all `take_delta()` results) is the
    output decoded so far, never ending in a broken character, without a
    suffix held back as a possible stop-string start. After a stop string hit
    it ends before the stop string (after it with `include_stop_str_in_output`);
    after `flush()` with no hit it equals the full decode of the output.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Tokens decode() removes; they neither add text nor close a byte run.
        self._skipped_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        if isinstance(stop, str):
            stop = (stop,)
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._max_stop = max(map(len, self._stop), default=0)
        self._include_stop = include_stop_str_in_output

        # Token window. _ids holds the prompt context, then every output id.
        self._ids: list[int] = []
        self._run_start: int | None = None  # index of the open byte-fallback run, if any
        prefix_text = ""
        context = _as_ids(prompt_token_ids[-_PROMPT_CONTEXT:]) if len(prompt_token_ids) else []
        if context:
            self._ids = context
            self._track(context, 0)
            prefix_text = self._decode(0, len(context))
            if self._run_start is not None or prefix_text.endswith(_REPLACEMENT):
                # The prompt ends inside a character: decode the output on its own.
                self._ids, self._run_start, prefix_text = [], None, ""
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = prefix_text
        self._pending = ""  # text of the unread tokens, as if the output ended now

        # Committed text: never changes, except that a stop string may cut its held-back tail.
        self._chunks: list[str] = []
        self._unsent = ""    # committed but not yet returned by take_delta()
        self._tail = ""      # last max_stop - 1 committed characters
        self._holdback = 0   # length of the committed suffix that may start a stop string
        self._final: str | None = None
        self._stop_str: str | None = None

    # ------------------------------------------------------------------ public

    @property
    def text(self) -> str:
        """The output text so far (see the class docstring)."""
        if self._final is not None:
            return self._final
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        full = self._chunks[0] if self._chunks else ""
        return full[: len(full) - self._holdback] if self._holdback else full

    @property
    def finished(self) -> bool:
        """True after a stop string hit or `flush()`."""
        return self._final is not None

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_str

    def update(self, new_token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Append newly generated ids; return the stop string they completed, if any.

        On a hit the output is finished: `text` is final and later `update`
        calls raise. `check_stop=False` appends without looking for stop
        strings (vLLM: none counts before `min_tokens` output tokens). Cost: one
        decode of the window (plus one when text is committed), independent of
        the output length.
        """
        if self._final is not None:
            raise RuntimeError("IncrementalDetokenizer.update() after the output finished "
                               f"({'stop string ' + repr(self._stop_str) if self._stop_str else 'flush()'})")
        new = _as_ids(new_token_ids)
        if not new:
            return None
        start = len(self._ids)
        self._ids.extend(new)
        self._track(new, start)

        n, p, r = len(self._ids), self._prefix_offset, self._read_offset
        prefix_len = len(self._prefix_text)
        new_text = self._decode(p, n)
        pending = new_text[prefix_len:]

        if self._stop and check_stop:
            hit = self._find_stop(pending)
            if hit is not None:
                self._finish_at_stop(pending, *hit)
                return self._stop_str

        # Commit up to the last point later tokens cannot change.
        end = n if self._run_start is None else self._run_start
        if end > r:
            text = new_text if end == n else self._decode(p, end)
            if len(text) > prefix_len and not text.endswith(_REPLACEMENT):
                self._commit(text[prefix_len:])
                pending = new_text[len(text):]
                self._prefix_offset, self._read_offset = r, end
                self._prefix_text = self._decode(r, end)
        self._pending = pending
        return None

    def take_delta(self) -> str:
        """Text added since the previous call (for streaming)."""
        keep = 0 if self._final is not None else self._holdback
        cut = len(self._unsent) - keep
        delta, self._unsent = self._unsent[:cut], self._unsent[cut:]
        return delta

    def flush(self) -> str:
        """Finish the output and return the rest of the text not yet taken.

        Call when the request finishes (any reason). Releases a held-back
        possible stop-string start and decodes still-unread tokens (an
        incomplete character then shows as U+FFFD, as in the full decode).
        Safe to call more than once.
        """
        if self._final is None:
            self._finish(0, self._pending)
        return self.take_delta()

    # ----------------------------------------------------------------- helpers

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _track(self, ids: list[int], start: int) -> None:
        """Follow the open run of byte-fallback pieces at the end of the window."""
        pieces = self._tok.convert_ids_to_tokens(ids)
        for i, (tid, piece) in enumerate(zip(ids, pieces)):
            if tid in self._skipped_ids:
                continue
            if _byte_piece(piece) is None:
                self._run_start = None
            elif self._run_start is None:
                self._run_start = start + i

    def _find_stop(self, pending: str) -> tuple[int, str] | None:
        """Earliest stop string in the last committed characters + `pending`.

        Returns (index relative to the end of the committed text, stop string).
        """
        region = self._tail + pending
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = region.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        return best[0] - len(self._tail), best[1]

    def _commit(self, delta: str) -> None:
        self._chunks.append(delta)
        self._unsent += delta
        if self._max_stop > 1:
            self._tail = (self._tail + delta)[-(self._max_stop - 1):]
            if not self._include_stop:
                self._holdback = self._partial_stop_len(self._tail)

    def _partial_stop_len(self, tail: str) -> int:
        """Length of the longest suffix of `tail` that begins some stop string."""
        for k in range(len(tail), 0, -1):
            suffix = tail[-k:]
            if any(s.startswith(suffix) for s in self._stop):
                return k
        return 0

    def _finish_at_stop(self, pending: str, rel: int, stop: str) -> None:
        cut = rel + len(stop) if self._include_stop else rel
        if cut >= 0:
            self._finish(0, pending[:cut])
        else:
            # The stop string starts in the committed text; that part was held back.
            self._finish(-cut, "")
        self._stop_str = stop

    def _finish(self, drop: int, extra: str) -> None:
        full = "".join(self._chunks)
        if drop:
            full = full[:-drop]
            self._unsent = self._unsent[: max(len(self._unsent) - drop, 0)]
        self._final = full + extra
        self._unsent += extra
        self._chunks = [self._final]
        self._holdback = 0
        self._pending = ""


def decode_token(tokenizer: TokenDecoder, token_id: int) -> str:
    """The text of one token on its own, for `Logprob.decoded_token`.

    Keeps a SentencePiece word piece's leading space ("▁Paris" -> " Paris",
    which a plain `decode([id])` strips), shows an ASCII byte piece as its
    character ("<0x0A>" -> "\\n"), and gives U+FFFD for a piece that is only
    part of a UTF-8 character (a non-ASCII byte piece, or a byte-level BPE
    piece like "â"), as `decode` does. Special tokens show their text.
    """
    token_id = int(token_id)
    piece = tokenizer.convert_ids_to_tokens([token_id])[0]
    if piece is None:
        return ""
    byte = _byte_piece(piece)
    if byte is not None:
        return chr(byte) if byte < 0x80 else _REPLACEMENT
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if piece.startswith("\u2581") and not text.startswith(" "):
        text = " " + text
    return text
