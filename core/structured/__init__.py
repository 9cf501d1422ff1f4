"""Structured outputs (vLLM's "structured_outputs"): constraints, their xgrammar
compilation (in a worker pool, off the engine's step: `compile_pool`) and
per-request grammar state. Only `params` is imported eagerly; `compiler` and
`manager` import xgrammar when used."""

from polyrunner.structured.params import CONSTRAINTS, StructuredOutputsParams

__all__ = ["CONSTRAINTS", "StructuredOutputsParams"]
