"""Llama-family decoders written once over the paged-attention interface."""
