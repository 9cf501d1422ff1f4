"""`LLM.chat`'s conversation handling in vLLM's shape (`vllm/entrypoints/chat_utils.py`):
one or several conversations, the message content format, and the render keywords.

`render_conversation` gives the prompt text transformers'
`tokenizer.apply_chat_template(..., tokenize=False)` gives for the same arguments.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ChatTemplateContentFormat = Literal["auto", "string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")

# what chat_template_kwargs may not set (vLLM refuses "chat_template" and "tokenize"; "messages"
# would collide with the conversation itself)
_RESERVED = ("chat_template", "tokenize", "messages")
# a template that loops over a message's content reads OpenAI's list-of-parts form
_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+[\w.]+(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


def conversations_of(messages: Sequence[Any]) -> list[list[dict[str, Any]]]:
    """One conversation (a list of message dicts) or a list of them -> a list of conversations."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a list of message dicts or a list of conversations, "
                        f"got {type(messages).__name__}")
    if messages and all(isinstance(m, (list, tuple)) for m in messages):
        return [list(c) for c in messages]
    return [list(messages)]


def render_kwargs(chat_template_kwargs: Mapping[str, Any] | None, *, add_generation_prompt: bool,
                  continue_final_message: bool, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The keywords a render gets: `chat_template_kwargs` (extra template variables),
    overridden by the named arguments as vLLM merges them (a `tools=None` leaves
    theirs). Reserved names raise vLLM's error."""
    extra = dict(chat_template_kwargs or {})
    if not all(isinstance(k, str) for k in extra):
        raise TypeError("chat_template_kwargs must map variable names (str) to values")
    reserved = {k for k in _RESERVED if k in extra}
    if reserved:
        raise ValueError(f"Found unexpected chat template kwargs from request: {reserved}")
    extra.update(add_generation_prompt=bool(add_generation_prompt),
                 continue_final_message=bool(continue_final_message))
    if tools is not None:
        extra["tools"] = tools
    return extra


def resolve_content_format(template: str | None, content_format: str) -> str:
    """vLLM's `chat_template_content_format`: "string" flattens a list of content parts into
    their text, "openai" gives every message a list of parts; "auto" picks "openai" for a
    template that loops over a message's content and "string" otherwise."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {content_format!r}")
    if content_format != "auto":
        return content_format
    return "openai" if template is not None and _LOOPS_OVER_CONTENT.search(template) else "string"


def format_content(conversation: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """Each message in `content_format` ("string" or "openai"); a copy, the caller's messages stay as given."""
    out = []
    for i, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {message!r} at index {i}")
        message = dict(message)
        content = message.get("content")
        if content_format == "string" and isinstance(content, (list, tuple)):
            message["content"] = "\n".join(_part_text(part, i) for part in content)
        elif content_format == "openai" and isinstance(content, str):
            message["content"] = [{"type": "text", "text": content}]
        out.append(message)
    return out


def _part_text(part: Any, index: int) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ValueError(f"message {index}: content part of type {kind!r} is not supported (text parts only: "
                     "polyrunner runs text models)")
