"""Models named by their Hugging Face name (`org/name`): the local cache first, then the Hub.

`huggingface_hub` is imported only here and only when a Hugging Face name is resolved
(it comes with `tokenizers`, but a plain install may lack it). Its own environment
variables apply: HF_HOME / HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE (never
download), HF_TOKEN (gated models).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["ALLOW_PATTERNS", "is_hub_name", "resolve_hub_model"]

# what polyrunner reads from a repository: config, tokenizer, chat template, safetensors weights
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]

_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_name(model: str) -> bool:
    """True when `model` reads as a Hugging Face name (`org/name`) and names no local path."""
    if Path(model).expanduser().exists():
        return False
    return bool(_NAME.match(model)) and ".." not in model and not model.endswith(".gguf")


def resolve_hub_model(name: str, revision: str | None = None) -> Path:
    """The local folder holding `name`'s config, tokenizer and weights: from the local
    Hugging Face cache without any network access, else downloaded (unless
    HF_HUB_OFFLINE is set). FileNotFoundError names the model, the cache folder and
    why neither worked."""
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise FileNotFoundError(f"model {name!r} is not a local folder or file, and huggingface_hub is not "
                                "installed to find it in the Hugging Face cache or download it "
                                "(pip install huggingface_hub)") from None
    cache = constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True, allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:   # LocalEntryNotFoundError (not cached), a bad name (HFValidationError), ...
        local_reason = ("no snapshot of it there" if type(exc).__name__ == "LocalEntryNotFoundError"
                        else f"{type(exc).__name__}: {exc}")
    where = f"not a local folder or file and not in the Hugging Face cache ({cache}: {local_reason})"
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"model {name!r} is {where}; HF_HUB_OFFLINE is set, so it is not downloaded")
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except Exception as exc:   # no network, unknown or gated repository, disk full, ...
        raise FileNotFoundError(f"model {name!r} is {where}, and downloading it failed: "
                                f"{type(exc).__name__}: {exc}") from None
