"""A `tokenizers.Tokenizer` from the vocabulary stored in a GGUF file's metadata.

A GGUF carries no tokenizer.json: only the tokens, their types, the merges (or
scores) and the special ids, under llama.cpp's key names. This rebuilds the
pipeline transformers builds for the same file (its GGUF tokenizer
integration), so the ids match `AutoTokenizer.from_pretrained(dir,
gguf_file=...)`:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE; the split regex picked by
  `tokenizer.ggml.pre` (llama3, qwen2, ...) or GPT-2's own;
- `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE with byte
  fallback and a `▁` prefix on the first word; merges from the file, or
  recovered from the token scores.

Control tokens become special added tokens, user-defined ones plain added
tokens; BOS/EOS are added by the post-processor when the file asks for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from polyrunner.models.gguf.errors import GGUFError

__all__ = ["build_tokenizer", "bytes_to_unicode"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split regex; any other value keeps GPT-2's ByteLevel regex (e.g. "smollm").
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_tokenizer(meta: dict[str, Any], path: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """`(tokenizer, tokenizer_config)` for the vocabulary in `meta` (a GGUF's metadata)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        tok = _byte_level(meta, tokens, path)
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens, path)
    else:
        raise GGUFError(
            f"{path}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
            f"supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE with byte fallback)"
        )

    # Control tokens (<|im_start|>, ...) are matched whole and are special; user-defined
    # ones (<think>, ...) are matched whole but are text. A byte-level vocabulary spells every
    # real token in the byte alphabet, so a "control" token outside it is a llama.cpp mislabel.
    alphabet = set(bytes_to_unicode().values()) if kind == "gpt2" else None
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)

    def token_of(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
    }
    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    missing = [t for t in special.values() if t is not None and t not in present]
    if missing:
        tok.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(missing)])

    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    tok.post_processor = _template(tok, special["bos_token"] if add_bos else None,
                                   special["eos_token"] if add_eos else None)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: v for k, v in special.items() if v is not None},
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(add_eos),
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return tok, config


def _byte_level(meta: dict[str, Any], tokens: list[str], path: Path) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens not spelled in the byte alphabet (rare llama.cpp quirk) are respelled byte by byte.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges(meta, tokens, path), dropout=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict[str, Any], tokens: list[str], path: Path) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=_merges(meta, tokens, path), fuse_unk=True, byte_fallback=True,
                        dropout=None))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1),
    ])
    return tok


def _merges(meta: dict[str, Any], tokens: list[str], path: Path) -> list[tuple[str, str]]:
    """The file's merges, or (SentencePiece files store scores instead) merges recovered from scores."""
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(m.split(" ")) for m in merges]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise GGUFError(f"{path}: the vocabulary has neither merges nor scores; cannot build the BPE model")
    return _generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))


def _generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best score first (transformers' `generate_merges`)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _template(tok: Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    single = f"{(bos + ':0 ') if bos else ''}$A:0{(' ' + eos + ':0') if eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if bos else ''} $B:1{(' ' + eos + ':1') if eos else ''}"
    specials = [(t, tok.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(specials)))
