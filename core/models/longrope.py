"""The rotary settings of rope_type "longrope" (Phi-3's, "su" in older configs) with
transformers' defaults made explicit, so the rotary tables need nothing else from config.json."""

from __future__ import annotations

import math
from typing import Any

from polyrunner.models.hf_config import ORIGINAL_MAX_DEFAULTS, HFDecoderConfig


def longrope_scaling(rope: dict[str, Any], c: HFDecoderConfig) -> dict[str, Any]:
    """`rope` (validated by `c`) plus, as transformers 5 resolves them:

    - `original_max_position_embeddings`: the top-level field when present (Phi-3 keeps it
      there, and transformers gives it priority; Phi3Config's default, 4096, when absent),
      else the rope settings' own;
    - `attention_factor` (cos/sin multiplier): the given one, else
      sqrt(1 + ln(factor) / ln(original)) when factor > 1 and 1.0 otherwise, where factor is
      the given one or max_position_embeddings / original."""
    original = (c.original_max_position_embeddings or ORIGINAL_MAX_DEFAULTS.get(c.model_type)
                or rope["original_max_position_embeddings"])
    factor = rope.get("factor") or c.max_position_embeddings / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return dict(rope, rope_type="longrope", original_max_position_embeddings=original,
                attention_factor=float(attention))
