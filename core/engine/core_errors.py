"""Errors of an engine core, shared by the frontend (`async_llm`) and the data-parallel cores."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop died; no request can be served until it is restarted."""


class ReplicaDeadError(EngineDeadError):
    """One data-parallel replica died: its requests failed; the other replicas keep serving."""
