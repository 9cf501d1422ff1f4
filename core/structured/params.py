"""`StructuredOutputsParams`: what a request's output must match (vLLM's names).

Exactly one constraint is set: `json` (a JSON schema, as a dict or a JSON
string), `regex`, `choice` (a list of strings), `grammar` (EBNF / GBNF, as
xgrammar reads it) or `json_object` (any JSON object). Anything else is a
ValueError with vLLM's wording. Whether a schema, regex or grammar compiles is
checked when the engine admits the request (`polyrunner.structured.compiler`),
which needs the tokenizer; the compiled grammar then rides along with the
parameters (`compiled`), to every runner that samples the request.

This module imports no grammar library: `SamplingParams` imports it.
"""

from __future__ import annotations

import functools
import json as _json
from dataclasses import dataclass, field, fields
from typing import Any

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


def too_deep(kind: str) -> ValueError:
    """The error for a constraint nested past what can be parsed (Python's RecursionError)."""
    return ValueError(f"structured_outputs.{kind}: the constraint is nested too deeply to be parsed")


@functools.lru_cache(maxsize=4)
def _tokenizer_info(serialized: str) -> Any:
    """xgrammar's TokenizerInfo from its JSON, once per process (every grammar shares it)."""
    import xgrammar
    return xgrammar.TokenizerInfo.deserialize_json(serialized)


@dataclass
class StructuredOutputsParams:
    """One output constraint, vLLM's `StructuredOutputsParams` (one of CONSTRAINTS set)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False   # True: JSON without free whitespace between tokens
    # the compiled grammar (an xgrammar CompiledGrammar), set by the engine at admission
    compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        count = sum(getattr(self, name) is not None for name in CONSTRAINTS)
        if count > 1:   # vLLM's wording
            raise ValueError("You can only use one kind of structured outputs constraint "
                             f"but multiple are specified: {self._fields()}")
        if count < 1:
            raise ValueError("You must use one kind of structured outputs constraint "
                             f"but none are specified: {self._fields()}")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or a JSON string); "
                                 f"the string does not parse: {exc}") from None
            except RecursionError:
                raise too_deep("json") from None
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings "
                             f"(got {self.choice!r})")
        if self.regex is not None and not self.regex:
            raise ValueError("structured_outputs.regex must be a non-empty regular expression (got '')")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("structured_outputs.grammar must be a non-empty EBNF grammar (got '')")
        if self.json_object is False:
            raise ValueError("structured_outputs.json_object must be True or None (got False)")

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @property
    def kind(self) -> str:
        """The constraint that is set: one of CONSTRAINTS."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    def key(self) -> tuple[str, str]:
        """The compiled-grammar cache key: (kind, canonical text of the constraint);
        ValueError for a JSON schema nested too deeply to serialise."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            try:
                value = _json.dumps(_json.loads(value) if isinstance(value, str) else value, sort_keys=True)
            except RecursionError:
                raise too_deep(kind) from None
            except (TypeError, ValueError) as exc:   # a dict holding what JSON cannot hold
                raise ValueError(f"structured_outputs.json must be a JSON schema: {exc}") from None
        elif kind == "choice":
            value = _json.dumps(value)
        if kind in ("json", "json_object"):
            value = f"{value}|ws={not self.disable_any_whitespace}"
        return kind, str(value)

    # The compiled grammar crosses processes serialised (tensor-parallel workers) and is
    # shared, not copied, by deepcopy (`SamplingParams.clone`, n > 1 children).
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        compiled = state.get("compiled")
        if compiled is not None:
            state["compiled"] = ("xgrammar", compiled.tokenizer_info.serialize_json(), compiled.serialize_json())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        compiled = state.get("compiled")
        if isinstance(compiled, tuple) and compiled[0] == "xgrammar":
            import xgrammar
            state["compiled"] = xgrammar.CompiledGrammar.deserialize_json(compiled[2], _tokenizer_info(compiled[1]))
        self.__dict__.update(state)

    def __deepcopy__(self, memo: dict[int, Any]) -> "StructuredOutputsParams":
        import copy
        new = StructuredOutputsParams.__new__(StructuredOutputsParams)
        for name, value in self.__dict__.items():
            new.__dict__[name] = value if name == "compiled" else copy.deepcopy(value, memo)
        return new
