"""polyrunner.engine.tokenizer.Tokenizer against transformers' AutoTokenizer on folders built here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from polyrunner.engine.tokenizer import PromptTooLong, Tokenizer  # noqa: E402

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Ünïcödé — 日本語のテキスト 🤗🚀, numbers 1234567 and 3.14",
    "def f(x):\n    return x ** 2\n\n\tindented\ttabs",
    "the cat sat on the mat; the dog sat on the log",
] * 4
TEXTS = [
    "Hello world",
    "  two leading spaces and   runs   of   spaces  ",
    "line one\nline two\n\n\ttabbed",
    "Ünïcödé — 日本語 🤗🚀👍🏽 emoji",
    "special tokens inline: <|begin|>hi<|end|> and <s>x</s> and <|unused|>",
    "",
    "a",
]
TEMPLATE = """{{ bos_token }}
{% set ns = namespace(system=false) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}
        {% set ns.system = true %}
    {% endif %}
<|{{ message['role'] }}|>
    {{ message['content'] | trim }}
    {% if loop.last and message['role'] == 'assistant' %}{{ eos_token }}{% endif %}

{% endfor %}
{% if tools %}
tools: {{ tools | tojson }}
{% endif %}
{% if not ns.system %}(no system prompt)
{% endif %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
MESSAGES = [
    {"role": "system", "content": "You are terse. <b>html</b> & \"quotes\""},
    {"role": "user", "content": "  What is 2+2?  "},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3? 🤔"},
]


def _byte_level_folder(folder: Path, tokenizer_class: str = "PreTrainedTokenizerFast", **cfg) -> Path:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|begin|>", "<|end|>", "<|pad|>"]))
    tok.add_special_tokens([AddedToken("<|unused|>", special=True, normalized=False)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": tokenizer_class, "bos_token": "<|begin|>", "eos_token": "<|end|>",
              "pad_token": "<|pad|>", "add_bos_token": True, "chat_template": TEMPLATE, **cfg}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _sentencepiece_folder(folder: Path) -> Path:
    """Llama-2 style: Metaspace, byte fallback, BOS via the post-processor; <s>/</s> in the vocab only."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + byte_tokens, initial_alphabet=[]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] == "<unk>"]  # <s>, </s>: vocab only
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>",
        "added_tokens_decoder": {"600": {"content": "<extra_0>", "special": True, "normalized": False,
                                         "lstrip": False, "rstrip": False, "single_word": False}},
    }))
    return folder


def _hf(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_encode_batch_refuses_a_text_over_max_tokens_naming_it(tmp_path):
    mine = Tokenizer.from_pretrained(_byte_level_folder(tmp_path / "t"))
    texts = [TEXTS[0], TEXTS[0] * 40]
    ids = mine.encode_batch(texts)
    assert ids == [mine.encode(t) for t in texts] and len(ids[1]) > len(ids[0])
    assert mine.encode_batch(texts, max_tokens=len(ids[1])) == ids          # at the limit: fine
    with pytest.raises(PromptTooLong) as caught:
        mine.encode_batch(texts, max_tokens=len(ids[1]) - 1)
    assert (caught.value.index, caught.value.num_tokens) == (1, len(ids[1]))


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_byte_level_encode_decode_match_transformers(tmp_path, add_bos):
    extra = {} if add_bos is None else {"add_bos_token": add_bos}
    folder = _byte_level_folder(tmp_path / "t", **extra)
    if add_bos is None:  # no flag at all: tokenizer.json's own post-processor (none) decides
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        del cfg["add_bos_token"]
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ref, mine = _hf(folder), Tokenizer.from_pretrained(folder)
    for text in TEXTS:
        for special in (True, False):
            ids = ref(text, add_special_tokens=special).input_ids
            assert mine.encode(text, add_special_tokens=special) == ids, (text, special)
        ids = ref(text).input_ids
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert mine.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
        assert mine.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert mine.bos_token_id == ref.bos_token_id and mine.eos_token_id == ref.eos_token_id
    assert mine.vocab_size == len(ref)
    assert set(ref.all_special_ids) <= mine.all_special_ids
    assert mine.backend is not None and mine.backend.token_to_id("<|end|>") == ref.eos_token_id


def test_sentencepiece_style_folder_matches_transformers(tmp_path):
    folder = _sentencepiece_folder(tmp_path / "spm")
    ref, mine = _hf(folder), Tokenizer.from_pretrained(folder)
    for text in TEXTS + [" leading", "x</s>y<s>z", "<extra_0> tail"]:
        ids = ref(text).input_ids
        assert mine.encode(text) == ids, text
        assert mine.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert mine.encode("hi")[0] == 1
    assert mine.token_to_id("<extra_0>") == ref.convert_tokens_to_ids("<extra_0>")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(tmp_path, add_generation_prompt):
    folder = _byte_level_folder(tmp_path / "t")
    ref, mine = _hf(folder), Tokenizer.from_pretrained(folder)
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = mine.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert got == want
    assert got.startswith("<|begin|>") and "You are terse. <b>html</b> & \"quotes\"" in got
    tools = [{"type": "function", "function": {"name": "f", "description": "é <x>"}}]
    assert mine.apply_chat_template(MESSAGES, add_generation_prompt, tools=tools) == ref.apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_chat_template_raise_exception_and_jinja_file(tmp_path):
    import jinja2

    folder = _byte_level_folder(tmp_path / "t")
    mine = Tokenizer.from_pretrained(folder)
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role: robot"):
        mine.apply_chat_template([{"role": "robot", "content": "beep"}])
    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    ref, mine = _hf(folder), Tokenizer.from_pretrained(folder)
    assert mine.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES, tokenize=False,
                                                                         add_generation_prompt=True)


def test_no_chat_template_is_a_clear_error(tmp_path):
    folder = _byte_level_folder(tmp_path / "t", chat_template=None)
    mine = Tokenizer.from_pretrained(folder)
    assert mine.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        mine.apply_chat_template(MESSAGES)
    with pytest.raises(ValueError):  # transformers agrees there is nothing to render
        _hf(folder).apply_chat_template(MESSAGES, tokenize=False)


def test_eos_ids_come_from_generation_config(tmp_path):
    folder = _byte_level_folder(tmp_path / "t")
    mine = Tokenizer.from_pretrained(folder)
    end, pad = mine.token_to_id("<|end|>"), mine.token_to_id("<|pad|>")
    assert mine.eos_token_ids == frozenset({end})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, pad]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    mine = Tokenizer.from_pretrained(folder)
    assert mine.eos_token_id == end
    assert mine.eos_token_ids == frozenset({end, pad, 7})


def test_from_folder_or_none(tmp_path):
    assert Tokenizer.from_folder_or_none(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    assert Tokenizer.from_folder_or_none(_byte_level_folder(tmp_path / "t")) is not None


def test_import_does_not_load_transformers():
    import subprocess

    code = "import sys, polyrunner.engine.tokenizer; print('transformers' in sys.modules, 'jinja2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.split() == ["False", "False"]
