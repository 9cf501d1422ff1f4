"""Served LoRA adapters (vLLM's `OpenAIServingModels`, its adapter half).

An adapter is served as a model of its own: a request whose `model` is an
adapter's name runs the base model with that adapter. Adapters come from
`--lora-modules` at start-up (vLLM's two forms: `name=path`, or JSON
'{"name": ..., "path": ..., "base_model_name": ...}') and from
`POST /v1/load_lora_adapter`; `POST /v1/unload_lora_adapter` drops one. The
server gives each adapter the next integer id (1, 2, ...), as vLLM does.

A load reads and checks the adapter (`polyrunner.lora.peft`) in the server's
thread pool, never on the event loop, then hands it to the engine
(`AsyncLLM.add_lora`); loads and unloads run one at a time. Answers and
messages are vLLM's: 400 for a bad load (the message names the problem), 404
for unloading a name that is not loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polyrunner.engine.async_llm import AsyncLLM, EngineDeadError, EngineNotAcceptingError
from polyrunner.lora.request import LoRARequest
from polyrunner.tools.serve import protocol as P
from polyrunner.tools.serve.offload import Offload

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's class): the adapter's name, its PEFT folder, and the
    served base model it belongs to (None: the first served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form; ValueError naming what is wrong."""
    if "=" in item and not item.lstrip().startswith("{"):
        name, _, path = item.partition("=")
        if not name or not path:
            raise ValueError(f"invalid --lora-modules entry {item!r}: expected name=path")
        return LoRAModulePath(name, path)
    try:
        fields = json.loads(item)
    except json.JSONDecodeError:
        raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"Invalid JSON format for --lora-modules: {item} (expected an object)")
    try:
        module = LoRAModulePath(**fields)
    except TypeError as exc:
        raise ValueError(f"Invalid fields for --lora-modules: {item} - {exc}") from None
    if not isinstance(module.name, str) or not isinstance(module.path, str) or not module.name or not module.path:
        raise ValueError(f"Invalid fields for --lora-modules: {item} - 'name' and 'path' must be non-empty strings")
    return module


class LoRAModulesAction(argparse.Action):
    """argparse action for `--lora-modules ENTRY [ENTRY ...]` (a list of `LoRAModulePath`)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        items = [values] if isinstance(values, str) else list(values or [])
        try:
            modules = [parse_lora_module(v) for v in items if v]
        except ValueError as exc:
            parser.error(str(exc))
        setattr(namespace, self.dest, modules)


def check_adapter_folder(path: str, llm: AsyncLLM) -> None:
    """Read the adapter at `path` and check it against the served model (a worker thread's job:
    disk reads and tensor work); ValueError / OSError naming the problem."""
    from polyrunner.lora.peft import check_adapter, read_adapter  # torch: only once LoRA is used
    lora, arch = llm.lora_config, llm.arch
    assert lora is not None and arch is not None
    check_adapter(read_adapter(path, lora.max_lora_rank), arch)


class ServedLoRAs:
    """The adapters the server serves, by name; see the module docstring."""

    def __init__(self, llm: AsyncLLM, base_names: list[str], offload: Offload) -> None:
        self.llm = llm
        self.base_names = base_names
        self.offload = offload
        self._by_name: dict[str, LoRARequest] = {}
        self._parents: dict[str, str] = {}
        self._last_id = 0
        self._lock: asyncio.Lock | None = None   # made on the server's loop at first use

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter served as `name`; None when no adapter has that name."""
        return self._by_name.get(name) if name else None

    def cards(self) -> list[P.ModelCard]:
        """vLLM's model cards of the adapters: `root` the adapter's folder, `parent` its base model."""
        return [P.ModelCard(id=name, root=req.lora_path, parent=self._parents[name])
                for name, req in self._by_name.items()]

    async def load_static(self, modules: list[LoRAModulePath]) -> None:
        """Load `--lora-modules` at start-up; ValueError naming the entry that failed."""
        for m in modules:
            try:
                await self.load(m.name, m.path, m.base_model_name)
            except P.RequestError as exc:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {exc.message}") from None

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> str:
        """Serve the adapter at `path` as `name`; vLLM's success message, or a RequestError."""
        if not name or not path:
            raise P.RequestError("Both 'lora_name' and 'lora_path' must be provided.",
                                 "lora_name" if not name else "lora_path")
        async with self._serialized():
            if name in self._by_name:
                raise P.RequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
            if name in self.base_names:
                raise P.RequestError(f"The lora adapter name '{name}' is the name of a served base model; "
                                     "choose another", "lora_name")
            if self.llm.lora_config is None:
                raise P.RequestError("LoRA is not enabled: start the server with --enable-lora", "lora_path")
            try:
                await self.offload.thread(check_adapter_folder, path, self.llm)
            except Exception as exc:   # noqa: BLE001 - a bad folder is the client's error
                raise P.RequestError(f"Loading lora adapter '{name}' failed: {exc}", "lora_path") from None
            self._last_id += 1
            request = LoRARequest(name, self._last_id, path)
            try:
                await self.llm.add_lora(request)
            except (EngineDeadError, EngineNotAcceptingError) as exc:
                raise P.RequestError(str(exc), None, 503, type="server_error") from None
            except (ValueError, TypeError, KeyError) as exc:
                raise P.RequestError(f"Loading lora adapter '{name}' failed: {exc}", "lora_path") from None
            self._by_name[name] = request
            self._parents[name] = base_model_name if base_model_name in self.base_names else self.base_names[0]
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        """Stop serving `name` and drop its adapter from the engine; vLLM's success message,
        or a RequestError (404 when no adapter has that name)."""
        if not name:
            raise P.RequestError("either 'lora_name' and 'lora_int_id' needs to be provided.", "lora_name")
        async with self._serialized():
            request = self._by_name.pop(name, None)
            if request is None:
                raise P.RequestError(f"The lora adapter '{name}' cannot be found.", "lora_name", 404,
                                     "lora_adapter_not_found")
            del self._parents[name]
            try:
                await self.llm.remove_lora(request.lora_int_id)
            except (EngineDeadError, EngineNotAcceptingError) as exc:
                raise P.RequestError(str(exc), None, 503, type="server_error") from None
            except (ValueError, TypeError, KeyError) as exc:   # no longer served either way
                logger.warning("the engine did not drop LoRA adapter '%s': %s", name, exc)
        logger.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _serialized(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock
