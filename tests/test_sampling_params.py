"""SamplingParams: defaults, validation messages, vocab checks, features, bad words."""

from __future__ import annotations

import re

import pytest

from polyrunner.sampling_params import SamplingParams, SamplingParamsError, SamplingType

VLLM_DEFAULTS = dict(
    n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, presence_penalty=0.0,
    frequency_penalty=0.0, repetition_penalty=1.0, seed=None, max_tokens=16, min_tokens=0,
    stop=[], stop_token_ids=[], ignore_eos=False, logprobs=None, prompt_logprobs=None,
    logit_bias=None, allowed_token_ids=None, bad_words=None, skip_special_tokens=True,
    include_stop_str_in_output=False, detokenize=True, logits_processors=None, structured_outputs=None,
)


def test_defaults_are_vllms():
    p = SamplingParams()
    assert p.model_dump() == VLLM_DEFAULTS
    assert set(SamplingParams.model_fields) == set(VLLM_DEFAULTS)


# (field, invalid value, regex the message must contain). Every field appears.
INVALID = [
    ("n", 0, r"n must be >= 1 \(got 0\)"),
    ("n", "two", r"n: Input should be a valid integer"),
    ("temperature", -1, r"temperature must be >= 0 \(got -1"),
    ("temperature", float("nan"), r"temperature must be a finite number"),
    ("temperature", float("inf"), r"temperature must be a finite number"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\] \(got 0"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\] \(got 1.5"),
    ("top_k", -2, r"top_k must be 0 or -1 \(disabled\) or >= 1 \(got -2\)"),
    ("top_k", 1.5, r"top_k: Input should be a valid integer"),
    ("min_p", -0.1, r"min_p must be in \[0, 1\] \(got -0.1"),
    ("min_p", 1.01, r"min_p must be in \[0, 1\]"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\] \(got 2.5"),
    ("presence_penalty", -2.01, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", -3, r"frequency_penalty must be in \[-2, 2\] \(got -3"),
    ("frequency_penalty", 2.01, r"frequency_penalty must be in \[-2, 2\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be > 0 \(got 0"),
    ("repetition_penalty", -1.0, r"repetition_penalty must be > 0"),
    ("seed", 2**64, r"seed must be in \[-2\*\*63, 2\*\*64 - 1\]"),
    ("seed", -(2**63) - 1, r"seed must be in"),
    ("seed", "abc", r"seed: Input should be a valid integer"),
    ("max_tokens", 0, r"max_tokens must be >= 1 or None \(got 0\)"),
    ("min_tokens", -1, r"min_tokens must be greater than or equal to 0, got -1\."),   # vLLM's wording
    ("stop", [""], r"stop must not contain an empty string"),
    ("stop", "", r"stop must not contain an empty string"),
    ("stop", [5], r"stop.0: Input should be a valid string"),
    ("stop_token_ids", [1, -1], r"stop_token_ids must all be >= 0"),
    ("stop_token_ids", ["x"], r"stop_token_ids.0: Input should be a valid integer"),
    ("ignore_eos", "perhaps", r"ignore_eos: Input should be a valid boolean"),
    ("logprobs", -2, r"logprobs must be None, -1 \(full vocabulary\) or >= 0 \(got -2\)"),
    ("prompt_logprobs", -5, r"prompt_logprobs must be None, -1 \(full vocabulary\) or >= 0"),
    ("logit_bias", {3: 100.5}, r"logit_bias values must be in \[-100, 100\] \(got 100.5 for token 3\)"),
    ("logit_bias", {3: -101}, r"logit_bias values must be in \[-100, 100\]"),
    ("logit_bias", {-1: 1.0}, r"logit_bias token ids must be >= 0"),
    ("logit_bias", {"x": 1.0}, r"logit_bias.x.\[key\]: Input should be a valid integer"),
    ("allowed_token_ids", [], r"allowed_token_ids must be None or a non-empty list"),
    ("allowed_token_ids", [0, -3], r"allowed_token_ids must all be >= 0"),
    ("bad_words", ["ok", "  "], r"bad_words must not contain empty or blank strings"),
    ("bad_words", "word", r"bad_words: Input should be a valid list"),
    ("skip_special_tokens", "perhaps", r"skip_special_tokens: Input should be a valid boolean"),
    ("include_stop_str_in_output", [], r"include_stop_str_in_output: Input should be a valid boolean"),
    ("detokenize", "perhaps", r"detokenize: Input should be a valid boolean"),
    ("logits_processors", [lambda logits: logits], r"logits_processors\[0\] must take \(output_token_ids, logits\)"),
    ("logits_processors", [5], r"logits_processors.0: Input should be callable"),
    ("structured_outputs", {"regex": "a", "choice": ["b"]},
     r"You can only use one kind of structured outputs constraint but multiple are specified"),
    ("structured_outputs", {}, r"You must use one kind of structured outputs constraint but none are specified"),
    ("structured_outputs", {"choice": []}, r"structured_outputs\.choice must be a non-empty list"),
]


def test_invalid_cases_cover_every_field():
    assert {f for f, _, _ in INVALID} == set(SamplingParams.model_fields)


@pytest.mark.parametrize("field,value,pattern", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_value_raises_with_field_and_range(field, value, pattern):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert isinstance(info.value, SamplingParamsError)
    assert field in msg
    assert re.search(pattern, msg), msg
    assert "\n" not in msg  # one readable line


@pytest.mark.parametrize("field,value,pattern", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_assignment_raises_and_keeps_old_value(field, value, pattern):
    p = SamplingParams()
    before = getattr(p, field)
    with pytest.raises(ValueError, match=pattern):
        setattr(p, field, value)
    assert getattr(p, field) == before


def test_unknown_field_forbidden():
    with pytest.raises(ValueError, match=r"best_off: Extra inputs are not permitted"):
        SamplingParams(best_off=2)


def test_min_tokens_le_max_tokens():
    # vLLM's wording
    with pytest.raises(ValueError, match=r"min_tokens must be less than or equal to max_tokens=16, got 17\."):
        SamplingParams(min_tokens=17)
    SamplingParams(min_tokens=16)
    p = SamplingParams(min_tokens=1000, max_tokens=None)
    with pytest.raises(ValueError, match="min_tokens must be less than or equal to max_tokens=10, got 1000"):
        p.max_tokens = 10
    assert p.max_tokens is None  # a failed cross-field assignment leaves the old value


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=1), dict(min_p=0.0),
    dict(min_p=1.0), dict(presence_penalty=-2.0), dict(frequency_penalty=2.0),
    dict(repetition_penalty=1e-3), dict(seed=0), dict(seed=2**64 - 1), dict(seed=-(2**63)),
    dict(max_tokens=None), dict(max_tokens=1), dict(logprobs=0), dict(logprobs=-1),
    dict(prompt_logprobs=0), dict(prompt_logprobs=-1), dict(logit_bias={0: 100.0, 1: -100.0}),
    dict(allowed_token_ids=[0]), dict(bad_words=["a b"]), dict(stop_token_ids=None),
])
def test_boundary_values_accepted(kw):
    SamplingParams(**kw)


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}  # JSON-style keys


@pytest.mark.parametrize("field,kw", [
    ("stop_token_ids", dict(stop_token_ids=[3, 10])),
    ("logit_bias token ids", dict(logit_bias={10: 1.0})),
    ("allowed_token_ids", dict(allowed_token_ids=[0, 9, 12])),
])
def test_validate_for_vocab(field, kw):
    p = SamplingParams(**kw)
    with pytest.raises(ValueError, match=re.escape(field) + r" must be in \[0, 10\)"):
        p.validate_for_vocab(10)
    p.validate_for_vocab(13)


def test_sampling_type():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=9e-6, seed=1).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-5).sampling_type == SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED


@pytest.mark.parametrize("kw,expected", [
    (dict(), {"temperature"}),
    (dict(temperature=0.0), set()),
    (dict(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1, seed=1), set()),  # no effect on greedy
    (dict(top_k=5), {"temperature", "top_k"}),
    (dict(top_p=0.9), {"temperature", "top_p"}),
    (dict(min_p=0.1), {"temperature", "min_p"}),
    (dict(seed=7), {"temperature", "seed"}),
    (dict(temperature=0.0, repetition_penalty=1.1), {"penalties"}),
    (dict(temperature=0.0, presence_penalty=0.1), {"penalties"}),
    (dict(temperature=0.0, frequency_penalty=-0.1), {"penalties"}),
    (dict(temperature=0.0, logit_bias={1: 1.0}), {"logit_bias"}),
    (dict(temperature=0.0, logit_bias={}), set()),
    (dict(temperature=0.0, allowed_token_ids=[1]), {"allowed_token_ids"}),
    (dict(temperature=0.0, bad_words=["x"]), {"bad_words"}),
    (dict(temperature=0.0, logprobs=0), {"logprobs"}),
    (dict(temperature=0.0, prompt_logprobs=2), {"prompt_logprobs"}),
])
def test_features(kw, expected):
    assert SamplingParams(**kw).features() == expected


def test_features_are_backend_feature_names():
    from polyrunner.device.backend import SAMPLING_FEATURES

    p = SamplingParams(top_k=2, top_p=0.5, min_p=0.1, seed=1, repetition_penalty=1.2,
                       logit_bias={1: 1}, allowed_token_ids=[1], bad_words=["x"], logprobs=1,
                       prompt_logprobs=1, logits_processors=[lambda out, row: row],
                       structured_outputs={"regex": "a+"})
    modes = {"raw_logits", "processed_logprobs", "processed_logits"}   # the engine's logprobs_mode
    assert p.features() == set(SAMPLING_FEATURES) - modes
    assert set().union(*(p.features(mode) for mode in modes)) == set(SAMPLING_FEATURES)


class WordTokenizer:
    """HF-style: encode(text, add_special_tokens) -> list[int]; ' word' is its own token."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        out, words = [], text.split(" ")
        for i, w in enumerate(words):
            if not w:
                continue
            key = ("Ġ" + w) if (i > 0) else w
            out.append(self.vocab[key])
        return out


class SentencePieceLike:
    """tokenizers-style: returns an Encoding with .ids; a leading space is a separate token."""

    class Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text: str, add_special_tokens: bool = True):
        ids = [99] if text.startswith(" ") else []
        ids += [ord(c) for c in text.strip()]
        return self.Enc(ids)


def test_bad_words_token_ids_with_and_without_space():
    tok = WordTokenizer({"bad": 1, "Ġbad": 2, "very": 3, "Ġvery": 4, "Ġword": 5})
    p = SamplingParams(bad_words=["bad", " very word"])
    # "bad" -> [1], " bad" -> [2]; "very word" -> [3, 5], " very word" -> [4, 5]
    assert p.bad_words_token_ids(tok) == [[1], [2], [3, 5], [4, 5]]


def test_bad_words_spaced_form_dropped_when_space_is_its_own_token():
    p = SamplingParams(bad_words=["ab"])
    # " ab" -> [99, 97, 98]: different length, so only the plain form is kept
    assert p.bad_words_token_ids(SentencePieceLike()) == [[97, 98]]


def test_bad_words_same_first_token_not_duplicated():
    tok = WordTokenizer({"x": 1, "Ġx": 1})
    assert SamplingParams(bad_words=["x"]).bad_words_token_ids(tok) == [[1]]
    assert SamplingParams().bad_words_token_ids(tok) == []
