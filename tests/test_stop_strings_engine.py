"""Stop strings, stop tokens and min_tokens through the engine, with a real tokenizer.

The tiny random model gets a small byte-level BPE tokenizer (512 ids, like
the model's vocabulary) trained here. `allowed_token_ids` keeps the random
model on a chosen alphabet (ASCII word pieces, or the raw bytes of "€"), so
the tests know which text it writes; seeded sampling makes every run of a
request write the same tokens, so a run with stop strings can be compared
with the same request run without them.
"""

import random
import shutil
from functools import lru_cache

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from polyrunner import LLM, SamplingParams

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' bos=1, eos=2
EOS = 2


def make_tokenizer_folder(model_folder, out):
    """Copy a tiny model folder and add a 512-id byte-level BPE tokenizer to it."""
    shutil.copytree(model_folder, out, dirs_exist_ok=True)
    rng = random.Random(0)
    syll = ["ka", "to", "ri", "me", "su", "no", "la", "pe", "di", "qu", "zo", "an", "el", "or", "is", "ut",
            "st", "op", "he", "re"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    words += ["café", "naïve", "€", "10€", "日本語", "über", "señor"]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    assert tok.get_vocab_size() == 512
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 512}')
    return out


@lru_cache(maxsize=None)
def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ByteLevel pieces are made of)."""
    from polyrunner.models.gguf.vocab import bytes_to_unicode
    return bytes_to_unicode()


def byte_token(tok, b: int) -> int:
    return tok.backend.token_to_id(_byte_to_char()[b])


def ascii_word_tokens(tok) -> list[int]:
    """Ids whose text is lowercase ASCII letters, maybe after one leading space."""
    ids = []
    for i in range(len(SPECIALS), 512):
        piece = tok.decode([i])
        body = piece[1:] if piece.startswith(" ") else piece
        if body and body.isascii() and body.isalpha() and body.islower():
            ids.append(i)
    return ids


@pytest.fixture(scope="module")
def llm(tiny_model_factory, tmp_path_factory):
    folder, _ = tiny_model_factory("llama")
    out = make_tokenizer_folder(folder, tmp_path_factory.mktemp("tiny-llama-tok"))
    return LLM(str(out), backend="cpu", dtype="float32", max_num_seqs=16)


@pytest.fixture(scope="module")
def words(llm):
    ids = ascii_word_tokens(llm.tokenizer)
    assert len(ids) > 100
    return ids


def _sp(seed: int, allowed, max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, allowed_token_ids=list(allowed), max_tokens=max_tokens,
                          ignore_eos=True, **kw)


PROMPT = {"prompt_token_ids": [1, 40, 41, 42, 300, 301]}


def _texts(tok, tokens: list[int]) -> list[str]:
    return [tok.decode(tokens[:m]) for m in range(len(tokens) + 1)]


def _expected_stop(tok, tokens: list[int], stops: list[str], min_tokens: int = 0):
    """Where the engine must stop: the first step m > min_tokens whose new text
    completes a stop string (the earliest starting one). Returns (m, text index, stop) or None."""
    texts = _texts(tok, tokens)
    for m in range(min_tokens + 1, len(tokens) + 1):
        # text that token m settled: past the common prefix (an incomplete character
        # at the end of texts[m - 1] decodes as U+FFFD and is replaced)
        old, new = texts[m - 1], texts[m]
        same = next((j for j, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        hits = []
        for s in stops:
            i = new.find(s, max(0, same - len(s) + 1))
            if i != -1:
                hits.append((i, s))
        if hits:
            i, s = min(hits)
            return m, i, s
    return None


def test_tokenizer_is_loaded(llm):
    tok = llm.tokenizer
    assert tok is not None and EOS in llm.engine._eos
    ids = tok.encode("10€ café naïve", add_special_tokens=False)
    assert tok.decode(ids) == "10€ café naïve"
    assert max(tok.encode("日本語 über", add_special_tokens=False)) < 512


@pytest.fixture(scope="module")
def ascii_base(llm, words):
    """Seeded runs on ASCII word pieces, without stop strings."""
    seeds = list(range(8))
    outs = llm.generate([PROMPT] * len(seeds), [_sp(s, words) for s in seeds], use_tqdm=False)
    tok = llm.tokenizer
    base = {}
    for s, o in zip(seeds, outs):
        c = o.outputs[0]
        assert c.finish_reason == "length" and c.text == tok.decode(c.token_ids)
        base[s] = c.token_ids
    return base


def _spanning_stop(tok, tokens: list[int]) -> str:
    """A stop string made of the end of one token and the start of the next."""
    for k in range(2, len(tokens)):
        left, right = tok.decode([tokens[k - 1]]), tok.decode([tokens[k]])
        if len(left) >= 2 and len(right) >= 2:
            return left[-2:] + right[:2]
    raise AssertionError("no two neighbouring multi-character tokens")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(llm, ascii_base, words, include):
    tok = llm.tokenizer
    seeds = sorted(ascii_base)
    stops = {s: _spanning_stop(tok, ascii_base[s]) for s in seeds}
    outs = llm.generate([PROMPT] * len(seeds),
                        [_sp(s, words, stop=[stops[s]], include_stop_str_in_output=include, logprobs=1)
                         for s in seeds], use_tqdm=False)
    for s, o in zip(seeds, outs):
        c = o.outputs[0]
        m, i, stop = _expected_stop(tok, ascii_base[s], [stops[s]])
        # the stop string really spans a token boundary: no single token's text contains it
        assert all(stop not in tok.decode([t]) for t in ascii_base[s][:m])
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.token_ids == ascii_base[s][:m]
        full = tok.decode(c.token_ids)
        assert c.text == (full[:i + len(stop)] if include else full[:i])
        assert include or stop not in c.text
        assert len(c.logprobs) == len(c.token_ids)
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_earliest_of_several_stop_strings(llm, ascii_base, words):
    tok = llm.tokenizer
    seed = 0
    tokens = ascii_base[seed]
    text = tok.decode(tokens)
    early, late = text[6:9], text[-4:]
    assert text.find(late) > 9, "pick other stop strings"
    out = llm.generate(PROMPT, _sp(seed, words, stop=[late, early]), use_tqdm=False)[0].outputs[0]
    m, i, stop = _expected_stop(tok, tokens, [late, early])
    assert stop == early
    assert out.finish_reason == "stop" and out.stop_reason == early
    assert out.token_ids == tokens[:m] and out.text == tok.decode(tokens[:m])[:i] == text[:i]


def test_multibyte_stop_string_and_no_broken_characters(llm):
    """Random raw bytes of "€" (E2 82 AC) and "a": the text grows without ever
    showing half a character, and a "€" stop string spanning three tokens is caught."""
    tok = llm.tokenizer
    alphabet = [byte_token(tok, b) for b in (0xE2, 0x82, 0xAC)] + [tok.backend.token_to_id("a")]
    seeds = list(range(16))
    params = [_sp(s, alphabet, max_tokens=40) for s in seeds]
    final, partial = {}, {}
    for out in llm.generate_stream([PROMPT] * len(seeds), params):
        c = out.outputs[0]
        partial.setdefault(out.request_id, []).append(c.text)
        if out.finished:
            final[out.request_id] = c
    assert len(final) == len(seeds)
    by_seed = dict(zip(seeds, (final[rid] for rid in sorted(final, key=int))))  # ids count up in prompt order
    for s, c in by_seed.items():
        assert c.token_ids == by_seed[s].token_ids
        assert c.text == tok.decode(c.token_ids)
    for rid, c in final.items():
        texts = partial[rid]
        assert texts[-1] == c.text
        for t in texts:  # never half a character: streamed text is only ever extended
            assert c.text.startswith(t), f"streamed {t!r} is not a prefix of {c.text!r}"
        assert all(len(a) <= len(b) for a, b in zip(texts, texts[1:]))
    with_euro = [s for s, c in by_seed.items() if "€" in c.text]
    assert with_euro, "no seed wrote a euro sign"
    outs = llm.generate([PROMPT] * len(with_euro), [_sp(s, alphabet, max_tokens=40, stop="€") for s in with_euro],
                        use_tqdm=False)
    for s, o in zip(with_euro, outs):
        c = o.outputs[0]
        tokens = by_seed[s].token_ids
        m, i, stop = _expected_stop(tok, tokens, ["€"])
        assert c.finish_reason == "stop" and c.stop_reason == "€"
        assert c.token_ids == tokens[:m] and c.token_ids[-1] == byte_token(tok, 0xAC)
        assert c.text == tok.decode(tokens[:m])[:i] and "€" not in c.text


def test_stop_token_ids(llm, words):
    tok = llm.tokenizer
    stop_id = words[7]
    piece = tok.decode([stop_id])
    for include in (False, True):
        sp = _sp(3, words, stop_token_ids=[stop_id], logit_bias={stop_id: 100.0},
                 include_stop_str_in_output=include)
        c = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
        assert c.token_ids == [stop_id]
        assert c.finish_reason == "stop" and c.stop_reason == stop_id
        assert c.text == (piece if include else "")  # vLLM: the stop token's text is left out


@pytest.mark.parametrize("min_tokens", [1, 5])
def test_min_tokens_with_stop_token_and_eos(llm, words, min_tokens):
    tok = llm.tokenizer
    stop_id = words[7]
    sp = _sp(3, words, stop_token_ids=[stop_id], logit_bias={stop_id: 100.0}, min_tokens=min_tokens)
    c = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == min_tokens + 1 and c.token_ids[-1] == stop_id
    assert stop_id not in c.token_ids[:-1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.text == tok.decode(c.token_ids[:-1])
    # EOS: masked until min_tokens, then (pushed by the bias) it ends the request
    sp = SamplingParams(temperature=1.0, seed=3, logit_bias={EOS: 100.0}, min_tokens=min_tokens, max_tokens=20)
    c = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == min_tokens + 1 and c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
    assert c.finish_reason == "stop" and c.stop_reason is None
    # ignore_eos: EOS does not stop it
    sp = SamplingParams(temperature=1.0, seed=3, logit_bias={EOS: 100.0}, min_tokens=min_tokens, max_tokens=8,
                        ignore_eos=True)
    c = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 8


def test_min_tokens_defers_stop_strings(llm, ascii_base, words):
    """A stop string completed within the first min_tokens tokens does not stop the request."""
    tok = llm.tokenizer
    seed = 1
    tokens = ascii_base[seed]
    texts = _texts(tok, tokens)
    stop = texts[3][-3:]  # completed by the third token at the latest
    first = _expected_stop(tok, tokens, [stop])
    assert first is not None and first[0] <= 3
    for min_tokens in (0, 6):
        c = llm.generate(PROMPT, _sp(seed, words, stop=stop, min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
        hit = _expected_stop(tok, tokens, [stop], min_tokens)
        if hit is None:
            assert c.finish_reason == "length" and c.token_ids == tokens and c.text == texts[-1]
        else:
            m, i, _ = hit
            assert m > min_tokens
            assert c.finish_reason == "stop" and c.stop_reason == stop
            assert c.token_ids == tokens[:m] and c.text == texts[m][:i]
        assert len(c.token_ids) > min_tokens
