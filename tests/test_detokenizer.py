"""IncrementalDetokenizer and decode_token, checked against the full decode.

Two small tokenizers are built here with the `tokenizers` library:
- a byte-level BPE (GPT-2 / Llama-3 / Qwen style), trained on a tiny corpus
  with "é", "€", "中" and emoji, so pieces can hold part of a character;
- a SentencePiece-like BPE with byte fallback ("<0x00>".."<0xFF>"), where
  "€", "中" and emoji exist only as byte pieces, with a Llama-2 style decoder
  (Replace "▁", ByteFallback, Fuse, Strip) or a Metaspace decoder.
The truth is always `tokenizers.Tokenizer.decode` of the whole sequence.
"""

from __future__ import annotations

import string

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from polyrunner.engine.detokenizer import IncrementalDetokenizer, decode_token

REPL = "\ufffd"
CHARS = ["a", "b", " ", "é", "€", "中", "😀", "🇫🇷", "\n", "hello", " world", "ab", "é€"]


class StandIn:
    """The part of polyrunner.engine.tokenizer.Tokenizer the detokenizer uses; records decode window sizes."""

    def __init__(self, backend: Tokenizer) -> None:
        self.backend = backend
        self.all_special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.decode_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        ids = [int(i) for i in ids]
        self.decode_lengths.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.backend.id_to_token(int(i)) for i in ids]


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>"], show_progress=False)
    corpus = ["hello world, hello there. €5 or 中文 café é 😀😀 🇫🇷 ab abc\n"] * 20
    tok.train_from_iterator(corpus, trainer)
    return tok


def _sentencepiece(decoder: str) -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = ["▁", "▁▁", *string.ascii_lowercase, *".,!?'", "é", "▁é", "▁a", "ab", "▁hello", "▁world", "hello",
              "▁▁▁"]
    for p in pieces:
        vocab.setdefault(p, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if decoder == "llama":
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace("▁", prepend_scheme="always")])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tok


BACKENDS = {"byte_level": _byte_level(), "sp_llama": _sentencepiece("llama"), "sp_metaspace": _sentencepiece("meta")}
KINDS = list(BACKENDS)


def _char_encodings(backend: Tokenizer) -> list[list[int]]:
    out = [backend.encode(c, add_special_tokens=False).ids for c in CHARS]
    if backend.token_to_id("<0xE2>") is not None:  # raw byte pieces, without the "▁" encode prepends
        out += [[backend.token_to_id(f"<0x{b:02X}>") for b in c.encode()] for c in ("€", "中", "😀", "é")]
    return [e for e in out if e]


@st.composite
def token_stream(draw, kind: str, max_segments: int = 18):
    """(ids, chunk sizes): random ids mixed with the pieces of whole characters."""
    backend = BACKENDS[kind]
    n_vocab = backend.get_vocab_size(with_added_tokens=True)
    specials = sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    segment = st.one_of(st.integers(0, n_vocab - 1).map(lambda i: [i]), st.sampled_from(_char_encodings(backend)),
                        st.sampled_from(specials).map(lambda i: [i]))
    ids = [i for seg in draw(st.lists(segment, max_size=max_segments)) for i in seg]
    sizes, left = [], len(ids)
    while left > 0:
        k = draw(st.integers(1, min(3, left)))
        sizes.append(k)
        left -= k
    return ids, sizes


def _chunks(ids, sizes):
    at = 0
    for k in sizes:
        yield ids[at:at + k]
        at += k


def _check_stream(detok, ids, sizes, truth):
    """Feed `ids` in `sizes` chunks; every intermediate text must be a prefix of `truth`."""
    deltas = []
    for chunk in _chunks(ids, sizes):
        assert detok.update(chunk) is None
        deltas.append(detok.take_delta())
        assert truth.startswith(detok.text), (detok.text, truth)
        if REPL not in truth:
            assert REPL not in detok.text and REPL not in deltas[-1]
        assert "".join(deltas) == detok.text
    deltas.append(detok.flush())
    assert detok.text == truth
    assert "".join(deltas) == truth
    assert detok.flush() == "" and detok.text == truth


SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- full decode equality


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_match_full_decode(kind, data, skip):
    ids, sizes = data.draw(token_stream(kind))
    tok = StandIn(BACKENDS[kind])
    truth = BACKENDS[kind].decode(ids, skip_special_tokens=skip)
    _check_stream(IncrementalDetokenizer(tok, [], skip_special_tokens=skip), ids, sizes, truth)


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_with_prompt_text_is_the_continuation(kind, data, skip):
    """With a prompt, the text is what the full decode adds after the prompt's decode."""
    backend = BACKENDS[kind]
    clean = [e for e in _char_encodings(backend) if all(backend.id_to_token(i)[:3] != "<0x" for i in e)]
    prompt = [i for seg in data.draw(st.lists(st.sampled_from(clean), min_size=1, max_size=8)) for i in seg]
    ids, sizes = data.draw(token_stream(kind))
    prompt_text = backend.decode(prompt, skip_special_tokens=skip)
    full = backend.decode(prompt + ids, skip_special_tokens=skip)
    assert full.startswith(prompt_text)
    truth = full[len(prompt_text):]
    if kind == "byte_level":  # byte-level decoding has no context: same as decoding the output alone
        assert truth == backend.decode(ids, skip_special_tokens=skip)
    _check_stream(IncrementalDetokenizer(StandIn(backend), prompt, skip_special_tokens=skip), ids, sizes, truth)


@pytest.mark.parametrize("kind", KINDS)
def test_real_text_streams_whole_characters(kind):
    backend = BACKENDS[kind]
    text = "hello €5, café 中文 😀😀 🇫🇷\nab é€ world"
    ids = backend.encode(text, add_special_tokens=False).ids
    truth = backend.decode(ids)
    assert truth.replace(" ", "") == text.replace(" ", "")  # the test tokenizer round-trips
    detok = IncrementalDetokenizer(StandIn(backend), [])
    deltas = []
    for i in ids:
        detok.update([i])
        deltas.append(detok.take_delta())
        assert REPL not in deltas[-1] and truth.startswith(detok.text)
    deltas.append(detok.flush())
    assert "".join(deltas) == truth == detok.text
    assert any(len(d) > 1 for d in deltas) or kind == "byte_level"  # byte pieces were held back, then released


def test_byte_fallback_euro_is_held_until_complete():
    backend = BACKENDS["sp_llama"]
    b = [backend.token_to_id(f"<0x{x:02X}>") for x in (0xE2, 0x82, 0xAC)]
    detok = IncrementalDetokenizer(StandIn(backend), [])
    detok.update([backend.token_to_id("a")])
    for i in b:
        detok.update([i])
        assert detok.text == "a" and REPL not in detok.take_delta()
    detok.update([backend.token_to_id("b")])  # closes the byte run
    assert detok.text == "a€b"
    # An invalid byte inside the run turns the whole run into U+FFFDs in the full decode; same here.
    ids = [*b, backend.token_to_id("<0xE2>"), backend.token_to_id("a")]
    detok = IncrementalDetokenizer(StandIn(backend), [])
    for i in ids:
        detok.update([i])
    assert detok.text == backend.decode(ids) == REPL * 4 + "a"


def test_skipped_special_token_does_not_close_a_byte_run():
    backend = BACKENDS["sp_llama"]
    euro = [backend.token_to_id(f"<0x{x:02X}>") for x in (0xE2, 0x82, 0xAC)]
    ids = [*euro, backend.token_to_id("<s>"), euro[0], backend.token_to_id("a")]
    for skip, want in ((True, REPL * 4 + "a"), (False, "€<s>" + REPL + "a")):
        assert backend.decode(ids, skip_special_tokens=skip) == want
        detok = IncrementalDetokenizer(StandIn(backend), [], skip_special_tokens=skip)
        for i in ids:
            detok.update([i])
            assert want.startswith(detok.text)
        assert detok.flush() and detok.text == want


def test_incomplete_character_at_finish_is_flushed_like_decode():
    backend = BACKENDS["byte_level"]
    ids = backend.encode("ab€", add_special_tokens=False).ids
    ids = ids + [backend.token_to_id("â")]  # first byte of "€" only
    detok = IncrementalDetokenizer(StandIn(backend), [])
    detok.update(ids)
    assert REPL not in detok.text
    rest = detok.flush()
    assert rest.endswith(REPL) and detok.text == backend.decode(ids)


def test_sentencepiece_spaces_and_prompt_context():
    backend = BACKENDS["sp_llama"]
    out = backend.encode("hello world", add_special_tokens=False).ids  # starts with "▁hello"-ish pieces
    assert backend.id_to_token(out[0]).startswith("▁")
    alone = IncrementalDetokenizer(StandIn(backend), [])
    alone.update(out)
    alone.flush()
    assert alone.text == backend.decode(out) == "hello world"
    prompt = backend.encode("say", add_special_tokens=False).ids
    ctx = IncrementalDetokenizer(StandIn(backend), prompt)
    for i in out:
        ctx.update([i])
    ctx.flush()
    assert ctx.text == " hello world"  # the continuation of "say"
    # A prompt of special tokens only gives no text context: same as decoding alone.
    bos = IncrementalDetokenizer(StandIn(backend), [backend.token_to_id("<s>")])
    bos.update(out)
    bos.flush()
    assert bos.text == backend.decode([backend.token_to_id("<s>"), *out]) == "hello world"


def test_window_stays_small():
    """O(window) per step: no decode call grows with the output length."""
    backend = BACKENDS["sp_llama"]
    ids = backend.encode("hello world, é 😀 ab " * 60, add_special_tokens=False).ids
    tok = StandIn(backend)
    prompt = ids[:50]
    detok = IncrementalDetokenizer(tok, prompt)
    for i in ids:
        detok.update([i])
    detok.flush()
    assert len(ids) > 600 and detok.text == backend.decode(prompt + ids)[len(backend.decode(prompt)):]
    assert max(tok.decode_lengths) <= 12  # 5 context tokens / a 4-byte character run + neighbours
    assert len(tok.decode_lengths) <= 3 * len(ids)


def test_numpy_ids():
    backend = BACKENDS["byte_level"]
    ids = np.array(backend.encode("héllo 中", add_special_tokens=False).ids, dtype=np.int64)
    detok = IncrementalDetokenizer(StandIn(backend), np.array([0, 1]))
    for i in range(len(ids)):
        detok.update(ids[i:i + 1])
    detok.flush()
    assert detok.text == "héllo 中"


# --------------------------------------------------------------------------- stop strings


def _sp_chars(text):
    """SentencePiece ids one piece per character (no merges in the test vocab)."""
    return BACKENDS["sp_llama"].encode(text, add_special_tokens=False).ids


def _feed(detok, ids):
    """Feed one id at a time; return (step index of the hit or None, stop, deltas)."""
    deltas = []
    for k, i in enumerate(ids):
        hit = detok.update([i])
        deltas.append(detok.take_delta())
        if hit is not None:
            return k, hit, deltas
    deltas.append(detok.flush())
    return None, None, deltas


def test_stop_string_spanning_tokens():
    backend = BACKENDS["sp_llama"]
    ids = _sp_chars("hello world again")
    assert [backend.id_to_token(i) for i in ids[5:8]] == ["o", "▁", "w"]
    detok = IncrementalDetokenizer(StandIn(backend), [], stop=["o w"])
    k, hit, deltas = _feed(detok, ids)
    assert (k, hit) == (7, "o w")  # found at the token that completes it
    assert detok.text == "hell" and detok.finished and detok.stop_str == "o w"
    assert "".join(deltas) + detok.flush() == "hell"
    with pytest.raises(RuntimeError):
        detok.update(ids[7:8])

    detok = IncrementalDetokenizer(StandIn(backend), [], stop=["o w"], include_stop_str_in_output=True)
    k, hit, deltas = _feed(detok, ids)
    assert (k, hit, detok.text) == (7, "o w", "hello w")
    assert "".join(deltas) + detok.flush() == "hello w"


def test_stop_string_at_very_start_and_in_one_multi_token_update():
    backend = BACKENDS["sp_llama"]
    detok = IncrementalDetokenizer(StandIn(backend), [], stop=["he"])
    assert detok.update(_sp_chars("h")) is None and detok.take_delta() == ""  # "h" may start "he"
    assert detok.update(_sp_chars("hello")[2:3]) == "he"
    assert detok.text == "" and detok.flush() == ""

    detok = IncrementalDetokenizer(StandIn(backend), [], stop=["zz", "lo w"])
    assert detok.update(_sp_chars("hello world")) == "lo w"  # text after the stop string is dropped
    assert detok.text == "hel" and detok.flush() == "hel"


def test_stop_string_inside_byte_pieces_is_found_at_once():
    backend = BACKENDS["sp_llama"]
    ids = [backend.token_to_id("a")] + [backend.token_to_id(f"<0x{b:02X}>") for b in "€x".encode()]
    detok = IncrementalDetokenizer(StandIn(backend), [], stop=["€"], include_stop_str_in_output=True)
    k, hit, _ = _feed(detok, ids)
    assert (k, hit, detok.text) == (3, "€", "a€")


def test_stream_holds_back_possible_stop_start():
    backend = BACKENDS["sp_llama"]
    detok = IncrementalDetokenizer(StandIn(backend), [], stop=["wor", "!!"])
    out = []
    for i in _sp_chars("hello wo"):
        detok.update([i])
        out.append(detok.take_delta())
    assert "".join(out) == "hello " and detok.text == "hello "  # "wo" held back
    detok.update(_sp_chars("x")[-1:])
    assert detok.take_delta() == "wox"
    detok.update(_sp_chars("!")[-1:])
    assert detok.take_delta() == "" and detok.text == "hello wox"
    assert detok.flush() == "!" and detok.text == "hello wox!"  # no stop completed: released at finish
    assert detok.stop_str is None

    inc = IncrementalDetokenizer(StandIn(backend), [], stop=["wor"], include_stop_str_in_output=True)
    inc.update(_sp_chars("hello wo"))
    assert inc.take_delta() == "hello wo"  # nothing to hold back: the stop string would be kept anyway


def _expected_stop(backend, ids, sizes, stops, include, skip):
    """Independent truth: after each chunk, search the full decode of the output so far."""
    end = 0
    for k in sizes:
        end += k
        text = backend.decode(ids[:end], skip_special_tokens=skip)
        found = [(text.find(s), j, s) for j, s in enumerate(stops) if s in text]
        if found:
            at, _, s = min(found)
            return end, s, text[:at + (len(s) if include else 0)]
    return None, None, backend.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(data=st.data(), include=st.booleans(), skip=st.booleans())
def test_random_stop_strings(kind, data, include, skip):
    backend = BACKENDS[kind]
    ids, sizes = data.draw(token_stream(kind))
    full = backend.decode(ids, skip_special_tokens=skip)
    from_text = st.integers(0, max(len(full) - 1, 0)).flatmap(
        lambda a: st.integers(1, 4).map(lambda n: full[a:a + n])).filter(bool)
    other = st.text(alphabet="ab €é中😀\n\ufffd", min_size=1, max_size=3)
    stops = data.draw(st.lists(st.one_of(from_text, other) if full else other, min_size=1, max_size=3,
                               unique=True))
    end, want_stop, want_text = _expected_stop(backend, ids, sizes, stops, include, skip)

    detok = IncrementalDetokenizer(StandIn(backend), [], skip_special_tokens=skip, stop=stops,
                                   include_stop_str_in_output=include)
    deltas, fed, got = [], 0, None
    for chunk in _chunks(ids, sizes):
        got = detok.update(chunk)
        fed += len(chunk)
        deltas.append(detok.take_delta())
        assert want_text.startswith(detok.text), (detok.text, want_text)  # nothing shown is taken back
        if got is not None:
            break
    deltas.append(detok.flush())
    assert got == want_stop
    if want_stop is not None:
        assert fed == end and detok.stop_str == want_stop
    assert detok.text == want_text
    assert "".join(deltas) == want_text


# --------------------------------------------------------------------------- decode_token


def test_decode_token():
    sp = StandIn(BACKENDS["sp_llama"])
    tid = sp.backend.token_to_id
    assert decode_token(sp, tid("▁hello")) == " hello"
    assert decode_token(sp, tid("▁")) == " "
    assert decode_token(sp, tid("hello")) == "hello"
    assert decode_token(sp, tid("<0x0A>")) == "\n"
    assert decode_token(sp, tid("<0x20>")) == " "
    assert decode_token(sp, tid("<0xE2>")) == REPL
    assert decode_token(sp, tid("<s>")) == "<s>"
    meta = StandIn(BACKENDS["sp_metaspace"])
    assert decode_token(meta, tid("▁world")) == " world"

    bl = StandIn(BACKENDS["byte_level"])
    for text in (" hello", "é", "😀"):
        for i in bl.backend.encode(text, add_special_tokens=False).ids:
            piece_text = decode_token(bl, i)
            assert piece_text == bl.backend.decode([i])
    assert decode_token(bl, bl.backend.token_to_id("Ġ")) == " "
    assert decode_token(bl, bl.backend.token_to_id("<|endoftext|>")) == "<|endoftext|>"


# --------------------------------------------------------------------------- polyrunner's Tokenizer


def test_with_polyrunner_tokenizer():
    mod = pytest.importorskip("polyrunner.engine.tokenizer")
    backend = _sentencepiece("llama")
    tok = mod.Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    ids = backend.encode("hello €5 café 中 😀 world", add_special_tokens=False).ids + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], stop=["wor"])
    k, hit, deltas = _feed(detok, ids)
    assert hit == detok.stop_str == "wor" and "".join(deltas) + detok.flush() == "hello €5 café 中 😀 "
    assert decode_token(tok, backend.token_to_id("▁world")) == " world"
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], skip_special_tokens=False)
    for i in ids:
        detok.update([i])
    detok.flush()
    assert detok.text == tok.decode([tok.bos_token_id, *ids], skip_special_tokens=False)[len("<s>"):]
