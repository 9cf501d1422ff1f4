"""What an engine process runs to build its engine, importable without the model stack."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyrunner.engine.llm_engine import LLMEngine


def engine_of(llm_kwargs: dict[str, Any]) -> LLMEngine:
    """`polyrunner.llm.engine_of` (`LLM(**llm_kwargs)`'s engine), imported only when called: the
    frontend that names it (pickled by reference) stays free of torch and the models."""
    from polyrunner.llm import engine_of as build
    return build(llm_kwargs)
