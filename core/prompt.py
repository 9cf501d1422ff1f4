"""What a request's prompt may be, vLLM's forms: a string, {"prompt": text}, or
{"prompt_token_ids": [...]} with an optional "prompt" text (the engine validates it)."""

from __future__ import annotations

from typing import Any, TypeAlias

Prompt: TypeAlias = str | dict[str, Any]
