"""The engine's max_model_len: the one rule, usable before the model is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyrunner.models.arch import DecoderArch
from polyrunner.models.loader import read_model_config
from polyrunner.models.source import resolve_model_folder

if TYPE_CHECKING:
    from polyrunner.config import EngineConfig


def max_model_len(arch: DecoderArch, config: EngineConfig) -> int:
    """`model.max_model_len`, else the model's max_position_embeddings (ValueError above it)."""
    limit = arch.max_position_embeddings
    wanted = config.model.max_model_len
    if wanted is not None and wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds the model's max_position_embeddings ({limit})")
    return wanted or limit


def resolved_max_model_len(config: EngineConfig) -> int:
    """`max_model_len` of `config`'s model, reading its config.json (for a backend that sizes
    something by it before the model is loaded, e.g. in `Backend.adjust_config`)."""
    _, arch = read_model_config(resolve_model_folder(config.model.model))
    return max_model_len(arch, config)
