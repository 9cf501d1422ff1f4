"""The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM): the plain decoder of
`decoder.py` (gated-SiLU MLP, fused qkv and gate_up projections, optional qkv
bias, q/k norms and sliding windows from the architecture)."""

from __future__ import annotations

from polyrunner.models.decoder import DecoderForCausalLM

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class LlamaForCausalLM(DecoderForCausalLM):
    """Token ids + positions + attention metadata + KV caches -> hidden states; see
    `DecoderForCausalLM`."""
