"""The runner's adapters: `max_loras` device slots and an LRU of adapters read into host memory.

A request names its adapter when it enters its slot (`NewRequest.lora_request`); the runner keeps
the adapter id per request slot (`RequestStates.lora_id`, 0: none). Each step, `prepare_step`
makes the step's adapters resident (the scheduler never schedules more distinct adapters than
slots), loading those that are not (from the host cache, else from their folder) into the least
recently used slots no row of the step needs, and writes every token's slot (-1: none) into the
mapping the `LoRALinear` modules read. Host work per step is vectorised over rows and tokens; the
only Python loop is over the step's distinct adapters.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from polyrunner.config import LoRAConfig
from polyrunner.distributed.shard import TPShard
from polyrunner.lora.model import LoRATarget, wrap_linears, write_embedding, write_lm_head, write_slot
from polyrunner.lora.peft import PeftAdapter, read_adapter
from polyrunner.lora.request import LoRARequest
from polyrunner.lora.vocab import LoRALogits
from polyrunner.models.arch import DecoderArch
from polyrunner.ops.lora import LoRAEmbedding, LoRAMapping

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, arch: DecoderArch, shard: TPShard, max_tokens: int,
                 dtype: torch.dtype, device: torch.device,
                 upload: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Wrap `model`'s linears (after the backend's other overrides) with `config.max_loras` empty slots.
        `upload`: the mapping's way to the device on a static-shape backend (`LoRAMapping`)."""
        self.config, self.arch, self.shard, self.upload = config, arch, shard, upload
        self.mapping = LoRAMapping(max_tokens, device, upload)
        self.targets: list[LoRATarget] = wrap_linears(model, arch, config, self.mapping, dtype, device)
        self.lm_head = LoRALogits(shard.vocab_per_rank, arch.hidden_size, config.max_loras, config.max_lora_rank,
                                  self.mapping, dtype, device)
        model.lm_head_lora = self.lm_head
        # replaced by the backend's "lora_embedding" op, which keeps these parameters
        self.embedding = LoRAEmbedding(arch.vocab_size, arch.hidden_size, config.max_loras, config.max_lora_rank,
                                       self.mapping, dtype, device)
        model.embed_lora = self.embedding
        if upload is not None:   # empty slots as device arrays, not lazy zeros
            for slot in range(config.max_loras):
                self._write(slot, None)
        self.requests: dict[int, LoRARequest] = {}            # adapter id -> where to read it
        self.host: OrderedDict[int, PeftAdapter] = OrderedDict()   # read adapters, least recently used first
        self.slots: OrderedDict[int, int] = OrderedDict()     # resident adapter id -> slot, LRU first
        self.free = list(range(config.max_loras))
        self._token_lora = np.full(max_tokens, -1, np.int32)

    # ---- adapters ---------------------------------------------------------------
    def register(self, request: LoRARequest) -> None:
        """A request's adapter (read when a step first needs it)."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            self.remove(request.lora_int_id)   # the same id now names another folder: read it again
        self.requests[request.lora_int_id] = request

    def remove(self, lora_id: int) -> None:
        """Drop adapter `lora_id`'s host copy and empty its slot (a request still running with it
        reads it again from its folder)."""
        self.host.pop(lora_id, None)
        slot = self.slots.pop(lora_id, None)
        if slot is not None:
            self._write(slot, None)
            self.free.append(slot)

    def _read(self, lora_id: int) -> PeftAdapter:
        adapter = self.host.get(lora_id)
        if adapter is None:
            request = self.requests[lora_id]
            adapter = read_adapter(request.lora_path, self.config.max_lora_rank)
            self.host[lora_id] = adapter
            while len(self.host) > self.config.cpu_capacity:
                self.host.popitem(last=False)
        self.host.move_to_end(lora_id)
        return adapter

    def _activate(self, ids: np.ndarray) -> np.ndarray:
        """Slots of the distinct adapter ids `ids` (> 0), loading those not resident."""
        wanted = ids.tolist()
        missing = [i for i in wanted if i not in self.slots]
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters; max_loras is {self.config.max_loras}")
        for lora_id in missing:
            if not self.free:   # evict the least recently used adapter this step does not use
                victim = next(i for i in self.slots if i not in wanted)
                self.free.append(self.slots.pop(victim))
            slot = self.free.pop()
            self._write(slot, self._read(lora_id))
            self.slots[lora_id] = slot
            logger.debug("adapter %d loaded into slot %d", lora_id, slot)
        for lora_id in wanted:
            self.slots.move_to_end(lora_id)
        return np.array([self.slots[i] for i in wanted], np.int32)

    def _write(self, slot: int, adapter: PeftAdapter | None) -> None:
        """Fill (None: empty) `slot` of every wrapped linear, of the embeddings and of the LM head."""
        write_slot(self.targets, slot, adapter, self.arch, self.shard, self.upload)
        write_embedding(self.embedding, slot, None if adapter is None else adapter.embed_tokens, self.upload)
        head = None if adapter is None else adapter.lm_head
        write_lm_head(self.lm_head, slot, head, self.shard, self.upload)

    # ---- steps ------------------------------------------------------------------
    def prepare_step(self, row_lora_ids: np.ndarray, token_to_req: np.ndarray, num_tokens: int,
                     logits_indices: np.ndarray) -> None:
        """Make the step's adapters resident and write each token's slot into the mapping:
        `row_lora_ids [R]` (0: no adapter), `token_to_req [T_pad]` (row of each token; the
        tokens past `num_tokens` are padding, slot -1), `logits_indices` (the token of each
        logits row)."""
        ids, inverse = np.unique(row_lora_ids, return_inverse=True)
        has = ids > 0
        row_slot = np.full(len(ids), -1, np.int32)
        if has.any():
            row_slot[has] = self._activate(ids[has])
        token_lora = self._token_lora[:len(token_to_req)]
        token_lora[:num_tokens] = row_slot[inverse][token_to_req[:num_tokens]]
        token_lora[num_tokens:] = -1
        self.mapping.set(torch.from_numpy(token_lora))
        if self.lm_head.slots:
            self.mapping.set_logits(torch.from_numpy(token_lora[logits_indices]))

    def prepare_logits(self, lora_id: int, num_rows: int) -> None:
        """The next `num_rows` logits rows are of one request with adapter `lora_id` (its prompt logprobs)."""
        if self.lm_head.slots:
            self.mapping.set_logits(torch.full((num_rows,), self.slots.get(lora_id, -1), dtype=torch.int32))
