"""Compile structured-output constraints with xgrammar, once per constraint.

`GrammarCompiler(tokenizer, vocab_size, stop_token_ids)` builds xgrammar's
`TokenizerInfo` from the model's Hugging Face tokenizer (our `Tokenizer`'s
`tokenizers` backend wrapped in transformers' `PreTrainedTokenizerFast`), with
the model's logits width as the vocabulary size (the mask covers every logit;
ids past the tokenizer's vocabulary are never allowed) and the engine's EOS ids
as the stop tokens (EOS is allowed exactly where the grammar may end).

`compile(params)` returns the `CompiledGrammar`, cached by `params.key()`
(an LRU of `cache_size` entries), and raises ValueError naming the field
(`structured_outputs.json`, `.regex`, `.grammar`, `.choice`) when xgrammar
refuses the constraint (or it is nested too deeply to parse). JSON (`json`, and
`json_object`: any object) allows free whitespace unless
`disable_any_whitespace`, at most JSON_MAX_WHITESPACE characters per gap.
`lookup(key)` is the cache alone. Both are thread-safe: the engine compiles in
a worker pool (`polyrunner.structured.compile_pool`), where xgrammar releases
the GIL. `LazyGrammarCompiler` defers building the compiler (xgrammar's
`TokenizerInfo` over the vocabulary: seconds) to its first `compile`, so that
too happens in a worker.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from polyrunner.structured.params import StructuredOutputsParams, too_deep

# JSON's free whitespace (vLLM's default, any_whitespace) is bounded to this many characters
# per gap: small models otherwise can emit newlines until max_tokens cuts the object.
JSON_MAX_WHITESPACE = 16
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def import_xgrammar() -> Any:
    """xgrammar, or an ImportError saying how to install it."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError("structured_outputs needs the xgrammar package: pip install 'polyrunner[structured]' "
                          f"(or pip install xgrammar) ({exc})") from None
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(exc: Exception) -> str:
    return _XGR_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


class GrammarCompiler:
    """xgrammar's compiler for one model's tokenizer, with a cache by constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_size: int = 256, max_threads: int = 2) -> None:
        xgr = import_xgrammar()
        from transformers import PreTrainedTokenizerFast  # an xgrammar dependency

        backend = getattr(tokenizer, "backend", tokenizer)   # our Tokenizer or a tokenizers.Tokenizer
        hf = tokenizer if isinstance(tokenizer, PreTrainedTokenizerFast) else \
            PreTrainedTokenizerFast(tokenizer_object=backend)
        stops = sorted(set(int(t) for t in stop_token_ids))
        if not stops:
            raise ValueError("structured outputs need the model's EOS token ids (none are known)")
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()   # the cache; compiles run outside it, concurrently
        self.cache_size = cache_size
        self.num_compiled = 0   # cache misses

    def lookup(self, key: tuple[str, str]) -> Any | None:
        """The cached `CompiledGrammar` of a `params.key()`, or None."""
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The `CompiledGrammar` of `params` (cached); ValueError naming the field if invalid."""
        key = params.key()
        hit = self.lookup(key)
        if hit is not None:
            return hit
        compiled = self._compile(params)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        c = self._compiler
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else params.json
                schema = schema if isinstance(schema, str) else json.dumps(schema)
                free = not params.disable_any_whitespace
                return c.compile_json_schema(schema, any_whitespace=free,
                                             max_whitespace_cnt=JSON_MAX_WHITESPACE if free else None)
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(params.choice))
            return c.compile_grammar(params.grammar)
        except RecursionError:
            raise too_deep(kind) from None
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar",
                    "choice": "choice list"}.get(kind, kind)
            raise ValueError(f"structured_outputs.{kind}: invalid {what}: {_clean(exc)}") from None


class LazyGrammarCompiler:
    """A `GrammarCompiler` built on the first `compile` (in the calling thread);
    `lookup` finds nothing before that. Same arguments as `GrammarCompiler`."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], **kw: Any) -> None:
        self._args = (tokenizer, vocab_size, frozenset(stop_token_ids))
        self._kw = kw
        self._lock = threading.Lock()
        self.compiler: GrammarCompiler | None = None

    def _get(self) -> GrammarCompiler:
        with self._lock:
            if self.compiler is None:
                self.compiler = GrammarCompiler(*self._args, **self._kw)
            return self.compiler

    def lookup(self, key: tuple[str, str]) -> Any | None:
        return None if self.compiler is None else self.compiler.lookup(key)

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self._get().compile(params)
