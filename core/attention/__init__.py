"""Attention: one metadata object for every device, a reference paged attention."""

from polyrunner.attention.metadata import NULL_BLOCK, NULL_SLOT, AttentionMetadata, LayerSpec
from polyrunner.attention.reference import reference_paged_attention, write_kv

__all__ = ["AttentionMetadata", "LayerSpec", "NULL_BLOCK", "NULL_SLOT",
           "reference_paged_attention", "write_kv"]
