"""The tokenizer: a `tokenizers.Tokenizer` plus what a Hugging Face folder says
around it (special tokens, BOS/EOS flags, end-of-generation ids, chat template).

It reads a local folder the way `transformers.AutoTokenizer` (v5) reads it, so
ids and chat prompts match transformers, without importing transformers:

- `tokenizer.json` is the pipeline (normalizer, pre-tokenizer, model, decoder,
  post-processor, added tokens);
- `tokenizer_config.json` may add tokens (`added_tokens_decoder`) and names
  the special tokens (`bos_token`, ...; each one becomes a special added token
  if it is not one already). Its `add_bos_token` / `add_eos_token` are ignored,
  as transformers v5 ignores them next to a tokenizer.json: whether BOS/EOS are
  added is the tokenizer.json post-processor's business;
- the chat template comes from `chat_template.jinja`, `chat_template.json` or
  `tokenizer_config.json`, and renders in a sandboxed jinja2 environment with
  transformers' settings (`trim_blocks`, `lstrip_blocks`, `raise_exception`,
  `tojson`, `strftime_now`, the special tokens as variables);
- end-of-generation ids are the EOS token plus every `eos_token_id` in
  `generation_config.json` and `config.json`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import tokenizers
from tokenizers import AddedToken, processors

if TYPE_CHECKING:   # jinja2 is imported lazily, with the first chat template
    import jinja2

__all__ = ["Tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class PromptTooLong(ValueError):
    """`Tokenizer.encode_batch(..., max_tokens=)`: text `index` has `num_tokens` tokens, more than allowed."""

    def __init__(self, index: int, num_tokens: int) -> None:
        super().__init__(f"text {index} has {num_tokens} tokens")
        self.index, self.num_tokens = index, num_tokens


class Tokenizer:
    """Encode, decode and format chats for one model.

    Build it with `from_pretrained(folder)`; the constructor takes an already
    built `tokenizers.Tokenizer` and the settings a folder would give.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        extra_special_tokens: Iterable[str] = (),
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
        name_or_path: str | None = None,
    ) -> None:
        self.backend = backend
        self.name_or_path = name_or_path
        self.special_tokens: dict[str, str] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.extra_special_tokens: tuple[str, ...] = tuple(extra_special_tokens)
        self.chat_template = chat_template
        self._clean_up = clean_up_tokenization_spaces

        # Like transformers: a named special token that is not an added token yet becomes one,
        # so it is matched whole in text instead of being split into pieces.
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in (*self.special_tokens.values(), *self.extra_special_tokens) if t not in present]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(missing)])

        # Given explicitly (not read from a folder), add_bos_token/add_eos_token rebuild the
        # post-processor the way transformers' `update_post_processor` does.
        if add_bos_token is not None or add_eos_token is not None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))

        eos = {i for i in extra_eos_token_ids if i is not None}
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self._eos_token_ids = frozenset(eos)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """Load the tokenizer of a local Hugging Face folder (needs `tokenizer.json`)."""
        folder = Path(path).expanduser()
        tok_file = folder / TOKENIZER_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(f"{folder}: no {TOKENIZER_FILE} in this folder; cannot build a tokenizer")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust error names the JSON problem
            raise ValueError(f"{tok_file}: cannot read this tokenizer file ({exc})") from None

        cfg = _read_json(folder / "tokenizer_config.json")
        legacy_map = _read_json(folder / "special_tokens_map.json")

        # Tokens the config lists by id that tokenizer.json does not carry.
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        extra_added = []
        for _, spec in sorted((cfg.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
            if isinstance(spec, Mapping) and spec.get("content") not in present:
                extra_added.append(AddedToken(**{k: v for k, v in spec.items() if not k.startswith("__")}))
        if extra_added:
            backend.add_tokens(extra_added)

        special = {}
        for name in _NAMED_SPECIAL:
            value = cfg.get(name, legacy_map.get(name))
            special[name] = _token_content(value)
        extras_raw = cfg.get("extra_special_tokens", cfg.get("additional_special_tokens"))
        if extras_raw is None:
            extras_raw = legacy_map.get("additional_special_tokens", ())
        if isinstance(extras_raw, Mapping):
            extras_raw = list(extras_raw.values())
        extras = [t for t in (_token_content(v) for v in extras_raw or ()) if t]

        if cfg.get("split_special_tokens"):
            backend.encode_special_tokens = True

        eos_ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            eos_ids += _as_id_list(_read_json(folder / name).get("eos_token_id"))

        return cls(
            backend,
            special_tokens=special,
            extra_special_tokens=extras,
            chat_template=_read_chat_template(folder, cfg),
            extra_eos_token_ids=eos_ids,
            clean_up_tokenization_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)),
            name_or_path=str(folder),
        )

    @classmethod
    def from_folder_or_none(cls, path: str | Path) -> "Tokenizer | None":
        """`from_pretrained(path)`, or None when the folder has no tokenizer.json."""
        if not (Path(path).expanduser() / TOKENIZER_FILE).is_file():
            return None
        return cls.from_pretrained(path)

    # ------------------------------------------------------------- encode/decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True,
                     max_tokens: int | None = None) -> list[list[int]]:
        """`encode` of each text; releases the GIL while it tokenizes (other threads run meanwhile).
        With `max_tokens`, a text of more tokens raises `PromptTooLong` before any id list is
        built: turning a million tokens into Python ints holds the GIL (and /health) for ~0.5 s."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        if max_tokens is not None:
            for index, encoding in enumerate(encodings):
                if len(encoding) > max_tokens:
                    raise PromptTooLong(index, len(encoding))
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return self._cleaned(text)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` of each id sequence; releases the GIL while it decodes (other threads run meanwhile)."""
        texts = self.backend.decode_batch([[int(i) for i in ids] for ids in batch],
                                          skip_special_tokens=skip_special_tokens)
        return [self._cleaned(t) for t in texts]

    def _cleaned(self, text: str) -> str:
        # transformers never applies the WordPiece-era clean-up to a BPE model (it corrupts text).
        if self._clean_up and type(self.backend.model).__name__ != "BPE":
            text = _clean_up_tokenization(text)
        return text

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # ---------------------------------------------------------------- properties

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS token id (or, lacking one, the smallest end-of-generation id)."""
        own = self._special_id("eos_token")
        if own is not None:
            return own
        ids = getattr(self, "_eos_token_ids", None)
        return min(ids) if ids else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: EOS plus generation_config/config `eos_token_id`s."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (transformers' `len(tok)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of every special added token and every named special token."""
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        for token in (*self.special_tokens.values(), *self.extra_special_tokens):
            i = self.backend.token_to_id(token)
            if i is not None:
                ids.add(i)
        return frozenset(ids)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, eos={sorted(self.eos_token_ids)})"

    # -------------------------------------------------------------- chat format

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template, as transformers'
        `apply_chat_template(..., tokenize=False)` would: keys whose value is None are
        dropped from each message; `tools`, `documents` and `kwargs` are template
        variables (kwargs override the special tokens); `continue_final_message`
        leaves the last message open (its end-of-turn cut off) so generation
        continues it, and excludes `add_generation_prompt`."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            where = f" ({self.name_or_path})" if self.name_or_path else ""
            raise ValueError(
                f"this tokenizer{where} has no chat template: the folder's tokenizer_config.json / "
                "chat_template.jinja (or the GGUF's tokenizer.chat_template) defines none. "
                "Pass a plain prompt instead, or pass chat_template=..."
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
                "when you want the model to continue the final message, and add_generation_prompt when you want "
                "to add a header that will prompt it to start a new assistant message instead."
            )
        chat = []
        for message in messages:
            if not isinstance(message, Mapping):
                raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
            chat.append({k: v for k, v in message.items() if v is not None})
        final = _mark_final_message(chat) if continue_final_message else None
        variables = {**self.special_tokens, **kwargs}
        rendered = _compile_template(template).render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return rendered if final is None else _cut_at_final_message(rendered, final)

    # ----------------------------------------------------------------- helpers

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """transformers' `update_post_processor`: `[BOS] $A [EOS]` from the named tokens."""
        bos = self.bos_token if add_bos else None   # None: not added
        eos = self.eos_token if add_eos else None
        single = f"{(bos + ':0 ') if bos is not None else ''}$A:0{(' ' + eos + ':0') if eos is not None else ''}"
        pair = (f"{single}{(' ' + bos + ':1') if bos is not None else ''} $B:1"
                f"{(' ' + eos + ':1') if eos is not None else ''}")
        specials = []
        if bos is not None:
            specials.append((bos, self.backend.token_to_id(bos)))
        if eos is not None:
            specials.append((eos, self.backend.token_to_id(eos)))
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# ---------------------------------------------------------------------- helpers


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return value.get("content")
    return str(value)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _read_chat_template(folder: Path, cfg: Mapping[str, Any]) -> str | None:
    """transformers' precedence: chat_template.jinja, chat_template.json, then the config."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template", cfg.get("chat_template"))
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


# transformers' marker for continue_final_message: appended to the final message, found in the render, cut there
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _mark_final_message(chat: list[dict[str, Any]]) -> str:
    """Append the marker to the last message's (last text part of its) content; returns that text."""
    if not chat:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    last = chat[-1] = dict(chat[-1])
    content = last.get("content")
    if content is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if isinstance(content, (list, tuple)):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                final: str = part["text"]
                part["text"] = final + _CONTINUE_TAG
                last["content"] = parts
                return final
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final "
                         "message!")
    last["content"] = content + _CONTINUE_TAG
    text: str = content
    return text


def _cut_at_final_message(rendered: str, final: str) -> str:
    """The render up to the marker (transformers' rule: trailing spaces the template trimmed stay trimmed)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template! This can happen if the chat template deletes portions of the "
                         "final message. Please verify the chat template and final message in your chat to ensure "
                         f"they are compatible.Final message to continue: {final.strip()}\nRendered chat:\n{rendered}")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


@functools.lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    """Compile a chat template in transformers' sandboxed environment (jinja2 imported lazily)."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> NoReturn:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own filter HTML-escapes; transformers' does not.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile: {exc} (line {exc.lineno})") from None
