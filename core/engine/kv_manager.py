"""Per-request block tables over the shared `BlockPool`."""

from __future__ import annotations

from polyrunner.engine.block_pool import BlockKey, BlockPool, chain_keys
from polyrunner.engine.request import Request
from polyrunner.numeric import cdiv


class KVCacheManager:
    """Owns which blocks each request holds; all block traffic goes through here."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.blocks: dict[str, list[int]] = {}
        self._keys: dict[str, list[BlockKey]] = {}   # keys of the request's cached full blocks
        # full blocks being computed this step (key -> request), so that a waiting request
        # with the same prefix waits a step and hits them instead of computing them again
        self._computing: dict[BlockKey, str] = {}
        self._computing_of: dict[str, list[BlockKey]] = {}

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    def take_cached_prefix(self, req: Request) -> int | None:
        """For a request with nothing computed: reuse cached full blocks of its
        tokens (leaving at least one token to compute). Returns tokens hit, or
        None (nothing taken) when the block after the cached ones is being
        computed this step by another request: admit it next step to hit it."""
        assert req.num_computed_tokens == 0 and req.request_id not in self.blocks
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed
        tokens = req.token_ids()
        keys = chain_keys(tokens, self.block_size, _root(req), num_blocks=(len(tokens) - 1) // self.block_size)
        if self._computing:
            n = self.pool.num_cached_prefix(keys)
            if n < len(keys) and keys[n] in self._computing:
                return None
        hits = self.pool.lookup(keys)
        self.pool.stats.hit_tokens += len(hits) * self.block_size
        self.blocks[req.request_id] = hits
        self._keys[req.request_id] = keys[:len(hits)]
        return len(hits) * self.block_size

    def allocate(self, req: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's blocks to hold computed + new tokens.
        Returns the newly added block ids, or None (nothing changed) when the pool is short."""
        held = self.blocks.setdefault(req.request_id, [])
        need = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - len(held)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            return None
        new = self.pool.allocate(need)
        held.extend(new)
        return new

    def mark_computing(self, req: Request, num_new_tokens: int) -> None:
        """Note the full blocks that this step's `num_new_tokens` complete (see
        `take_cached_prefix`); `cache_computed` or `free` clears the note."""
        if not self.enable_prefix_caching:
            return
        keys = self._keys.get(req.request_id, ())
        n_full = (req.num_computed_tokens + num_new_tokens) // self.block_size
        if n_full <= len(keys):
            return
        parent = hash(keys[-1]) if keys else _root(req)
        new_keys = chain_keys(req.token_ids(), self.block_size, parent, len(keys), n_full)
        self._computing_of[req.request_id] = new_keys
        for key in new_keys:
            self._computing.setdefault(key, req.request_id)

    def _done_computing(self, request_id: str) -> None:
        for key in self._computing_of.pop(request_id, ()):
            if self._computing.get(key) == request_id:
                del self._computing[key]

    def cache_computed(self, req: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        if self._computing_of:
            self._done_computing(req.request_id)
        keys = self._keys.setdefault(req.request_id, [])
        n_full = req.num_computed_tokens // self.block_size
        if n_full <= len(keys):
            return
        parent = hash(keys[-1]) if keys else _root(req)
        new_keys = chain_keys(req.token_ids(), self.block_size, parent, len(keys), n_full)
        self.pool.cache(self.blocks[req.request_id][len(keys):n_full], new_keys)
        keys.extend(new_keys)

    def block_ids(self, req: Request) -> list[int]:
        """A copy of the blocks the request holds, in order."""
        return list(self.blocks.get(req.request_id, ()))

    def free(self, req: Request) -> None:
        self.pool.free(self.blocks.pop(req.request_id, []))
        self._keys.pop(req.request_id, None)
        if self._computing_of:
            self._done_computing(req.request_id)

    def num_held_blocks(self) -> int:
        return sum(len(b) for b in self.blocks.values())


def _root(req: Request) -> int:
    """The parent of a request's first block key: its adapter's, so requests share cached blocks
    only with requests of the same adapter (vLLM's extra hash key)."""
    return 0 if req.lora_request is None else hash(("lora", req.lora_request.lora_int_id))
