"""A data-parallel replica's share of the host, taken in its engine process before
the engine starts: the backend's `init_rank(replica, replicas)`, the hook tensor-
parallel ranks use (on CPU: a contiguous share of the physical cores, and the
engine's thread count follows it). A replica that runs tensor parallelism itself
keeps the whole host: its ranks split it with their own `init_rank` calls.
"""

from __future__ import annotations

from typing import Any


def take_share(llm_kwargs: dict[str, Any], replica: int, replicas: int) -> None:
    """Give this process replica `replica` of `replicas`'s share of the host (nothing
    for a single replica or a tensor-parallel one)."""
    if replicas < 2 or int(llm_kwargs.get("tensor_parallel_size") or 1) > 1:
        return
    from polyrunner.config import EngineConfig, ModelConfig
    from polyrunner.plugins import select_backend

    backend_cls = select_backend(llm_kwargs.get("backend"))
    # a backend is cheap to make (it keeps its config); only its init_rank is needed here
    backend_cls(EngineConfig(model=ModelConfig(model=llm_kwargs.get("model")))).init_rank(replica, replicas)
