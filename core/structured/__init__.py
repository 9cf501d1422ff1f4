"""Structured outputs (vLLM's "structured_outputs"): constraints, their xgrammar
compilation and per-request grammar state. Only `params` is imported eagerly;
`compiler` and `manager` import xgrammar when used."""

from polyrunner.structured.params import CONSTRAINTS, StructuredOutputsParams

__all__ = ["CONSTRAINTS", "StructuredOutputsParams"]
