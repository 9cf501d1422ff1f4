"""Stream-graph machinery for backends whose device module follows the CUDA
API (graphs, memory pools, events, streams, memory statistics): the CUDA and
Ascend backends pass their device module or a small `GraphAPI`; nothing here
imports a device library.

- `graph_bucket_policy`: capture sizes `[1, 2, 4, 8, 16, 24, ...]` on both
  axes up to `min(max_num_seqs, 512, max_num_batched_tokens)`; a batch above
  the largest size runs unpadded (eager). Graphs are decode-only (one token
  per request), so a graph larger than `max_num_seqs` could never be replayed:
  unlike vLLM's `2 * max_num_seqs` (which serves speculative decoding's
  several tokens per request) the list stops at `max_num_seqs`.
- `StaticGraphExecutor`: full-model graphs for decode-only batches, keyed by
  (batch size, context width), captured largest first into one shared memory
  pool, replayed after copying the step's inputs into static buffers;
  everything else runs eagerly. Inside a graph, decode attention reads a fixed
  number of blocks per request, so its cost follows the graph's context width,
  not the live context: widths step by 4x (512, 2048, 8192 tokens, capped at
  `max_seq_len_to_capture` and the block-table width) keep that within 4x of
  the batch's longest context; a longer context runs eagerly.
- `profiled_kv_budget`, `async_to_host`, `pinned_upload`: memory profiling and
  host<->device transfers over a CUDA-like device module.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from polyrunner.attention.metadata import AttentionMetadata
from polyrunner.device.backend import GraphExecutor, HostFuture, ModelInputs
from polyrunner.device.buckets import BucketPolicy, capture_sizes
from polyrunner.attention.batched import STATIC_DECODE

logger = logging.getLogger(__name__)
MAX_CAPTURE_SIZE = 512


# ---- buckets ---------------------------------------------------------------
@dataclass(frozen=True)
class GraphBucketPolicy(BucketPolicy):
    """Capture-size buckets; a batch above the largest bucket is not padded."""

    def pad(self, num_tokens: int, num_reqs: int) -> tuple[int, int]:
        return _up(self.token_buckets, num_tokens), _up(self.request_buckets, num_reqs)

    def max_padding(self, n: int, axis: str = "tokens") -> int:
        buckets = self.token_buckets if axis == "tokens" else self.request_buckets
        if not buckets or n > buckets[-1]:
            return 0
        return super().max_padding(n, axis)


def _up(buckets: list[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def graph_bucket_policy(config) -> BucketPolicy:
    """Capture sizes (or `runner.token_buckets`/`request_buckets`); none under enforce_eager."""
    if config.runner.enforce_eager:
        return BucketPolicy()
    sched = config.scheduler
    top = min(sched.max_num_seqs, MAX_CAPTURE_SIZE, sched.max_num_batched_tokens)
    tokens = sorted(set(config.runner.token_buckets or capture_sizes(top)))
    reqs = sorted(set(config.runner.request_buckets or tokens))
    return GraphBucketPolicy(tokens, reqs)


# ---- graphs ----------------------------------------------------------------
class GraphAPI:
    """How a device captures and replays a graph. `capture(fn, pool)` runs
    `fn` under capture and returns `(replay, output)`."""

    name = "graph"

    def pool(self) -> Any:
        return None

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
        raise NotImplementedError

    def synchronize(self) -> None:
        return None

    def free_memory(self) -> int:
        return 0

    def explain(self, exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"


class TorchGraphAPI(GraphAPI):
    """A device module's graph class and capture context (CUDA-style API)."""

    def __init__(self, mod: Any, graph_class: str, name: str) -> None:
        self.mod, self.graph_class, self.name = mod, graph_class, name

    def pool(self) -> Any:
        return self.mod.graph_pool_handle()

    def capture(self, fn, pool):
        graph = getattr(self.mod, self.graph_class)()
        with self.mod.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out

    def synchronize(self) -> None:
        self.mod.synchronize()

    def free_memory(self) -> int:
        return int(self.mod.mem_get_info()[0])


@dataclass
class _Static:
    """Static input buffers sized for the largest graph; graph B reads `[:B]`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    token_to_req: torch.Tensor

    @classmethod
    def like(cls, inputs: ModelInputs) -> "_Static":
        m = inputs.attn
        B = inputs.input_ids.shape[0]
        z = lambda t, n=B: torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)  # noqa: E731
        return cls(z(inputs.input_ids), z(inputs.positions), z(m.slot_mapping), z(m.seq_lens),
                   z(m.block_tables), z(m.query_start_loc, B + 1), z(m.token_to_req))

    def load(self, inputs: ModelInputs, B: int, W: int) -> None:
        m = inputs.attn
        self.input_ids[:B].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:B].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:B].copy_(m.slot_mapping, non_blocking=True)
        self.seq_lens[:B].copy_(m.seq_lens, non_blocking=True)
        self.block_tables[:B, :W].copy_(m.block_tables[:, :W], non_blocking=True)
        self.query_start_loc[: B + 1].copy_(m.query_start_loc, non_blocking=True)
        self.token_to_req[:B].copy_(m.token_to_req, non_blocking=True)

    def meta(self, B: int, W: int, block_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=B, num_reqs=B, num_decodes=B, max_query_len=1,
            max_seq_len=W * block_size, query_start_loc=self.query_start_loc[: B + 1],
            seq_lens=self.seq_lens[:B], block_tables=self.block_tables[:B, :W],
            slot_mapping=self.slot_mapping[:B], positions=self.positions[:B],
            token_to_req=self.token_to_req[:B], extras={STATIC_DECODE: True})


@dataclass
class _Graph:
    replay: Callable[[], None]
    output: torch.Tensor


@dataclass
class StaticGraphExecutor(GraphExecutor):
    """Decode-only full-model graphs over static buffers; eager otherwise.

    `prepare` captures, for every token bucket B (B requests of one token each,
    B <= max_num_seqs) and every context width W (in blocks), one graph,
    largest first, all in one memory pool; each capture follows `num_warmups`
    eager runs. `run` replays graph (B, smallest W covering the longest
    context) when the batch is decode-only, padded to a captured size, and
    uses the KV caches the graphs were captured with; anything else runs
    eagerly (logged once per reason). A failed capture discards every graph
    and the executor stays eager, with a warning saying why.
    """

    model: torch.nn.Module
    api: GraphAPI
    max_num_seqs: int
    enforce_eager: bool = False
    num_warmups: int = 1
    max_seq_len_to_capture: int = 8192
    context_buckets: tuple[int, ...] = (512, 2048)  # tokens; plus the capped maximum
    graphs: dict[tuple[int, int], _Graph] = field(default_factory=dict)
    capture_seconds: float = 0.0
    capture_bytes: int = 0
    disabled_reason: str | None = None
    _static: _Static | None = None
    _kv: list[torch.Tensor] | None = None
    _kv_ptrs: list[int] = field(default_factory=list)
    _widths: list[int] = field(default_factory=list)  # context widths in blocks, ascending
    _block_size: int = 0
    _capturing: int | None = None
    _pool: Any = None
    _warned: set[str] = field(default_factory=set)

    def prepare(self, run_dummy: Callable[[int, int], Any], buckets: BucketPolicy) -> None:
        if self.enforce_eager:
            logger.info("%s: enforce_eager is set; no graphs are captured", self.api.name)
            return
        sizes = [b for b in buckets.token_buckets if b <= self.max_num_seqs and buckets.pad(b, b) == (b, b)]
        if not sizes:
            return
        t0, free0 = time.perf_counter(), self.api.free_memory()
        self._pool = self.api.pool()
        gc.collect()
        size = sizes[-1]
        try:
            for size in reversed(sizes):  # largest first: smaller graphs reuse its pool
                self._capturing = size
                run_dummy(size, size)
        except Exception as exc:  # noqa: BLE001 - any capture failure means eager
            self.disabled_reason = f"capture failed at batch size {size}: {self.api.explain(exc)}"
            self.graphs.clear()
            self._static = self._pool = None
            logger.warning("%s: %s; running every batch eagerly", self.api.name, self.disabled_reason)
        finally:
            self._capturing = None
            self.api.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free0 - self.api.free_memory())
        logger.info("%s: captured %d graphs (batch sizes %s x context widths %s tokens) in %.2fs using "
                    "%.1f MiB", self.api.name, len(self.graphs), sorted({b for b, _ in self.graphs}),
                    [w * self._block_size for w in self._widths], self.capture_seconds, self.capture_bytes / 2**20)

    def num_graphs(self) -> int:
        return len(self.graphs)

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        if self._capturing is not None:
            return self._capture(inputs, self._capturing)
        key = self._dispatch(inputs)
        if key is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches)
        self._static.load(inputs, *key)
        graph = self.graphs[key]
        graph.replay()
        return graph.output

    def _capture(self, inputs: ModelInputs, B: int) -> torch.Tensor:
        m = inputs.attn
        if inputs.input_ids.shape[0] != B or m.num_padded_reqs != B or m.max_query_len != 1:
            raise RuntimeError(f"capture of size {B} got a batch of {inputs.input_ids.shape[0]} tokens, "
                               f"{m.num_padded_reqs} requests, max_query_len {m.max_query_len}")
        if self._static is None:  # the first (largest) capture sizes the static buffers
            self._static = _Static.like(inputs)
            self._kv, self._kv_ptrs = inputs.kv_caches, [t.data_ptr() for t in inputs.kv_caches]
            self._block_size = bs = inputs.kv_caches[0].shape[2]
            top = min(m.block_tables.shape[1], -(-self.max_seq_len_to_capture // bs))
            self._widths = sorted({-(-t // bs) for t in self.context_buckets if -(-t // bs) < top} | {top})
        st, kv = self._static, self._kv
        for W in reversed(self._widths):  # widest first, like the batch sizes
            st.load(inputs, B, W)
            meta = st.meta(B, W, self._block_size)

            def forward(meta=meta) -> torch.Tensor:
                return self.model(st.input_ids[:B], st.positions[:B], meta, kv)

            for _ in range(self.num_warmups):
                forward()
            self.api.synchronize()
            replay, out = self.api.capture(forward, self._pool)
            self.graphs[(B, W)] = _Graph(replay, out)
        return out

    def _dispatch(self, inputs: ModelInputs) -> tuple[int, int] | None:
        if not self.graphs:
            return None
        m = inputs.attn
        B = inputs.input_ids.shape[0]
        if m.max_query_len != 1 or m.num_actual_tokens != m.num_reqs:
            self._warn_once("mixed", "batches with prefill tokens run eagerly (graphs are decode-only)")
            return None
        W = next((w for w in self._widths if w * self._block_size >= m.max_seq_len), None)
        if W is None:
            self._warn_once("long", f"decode context of {m.max_seq_len} tokens exceeds the widest graph "
                                    f"({self._widths[-1] * self._block_size}, max_seq_len_to_capture="
                                    f"{self.max_seq_len_to_capture}); running eagerly")
            return None
        if (B, W) not in self.graphs:
            largest = max(b for b, _ in self.graphs)
            reason = (f"decode batch of {B} exceeds the largest captured graph ({largest}); running eagerly"
                      if B > largest else f"no graph was captured for padded size {B}; running eagerly")
            self._warn_once(f"size{B > largest}", reason)
            return None
        if m.num_padded_reqs != B or m.block_tables.shape[1] < W:
            self._warn_once("shape", f"batch padded to {m.num_padded_reqs} requests for {B} tokens; running eagerly")
            return None
        if inputs.kv_caches is not self._kv and [t.data_ptr() for t in inputs.kv_caches] != self._kv_ptrs:
            self._warn_once("kv", "KV caches differ from those the graphs were captured with; running eagerly")
            return None
        return B, W

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            (logger.info if key == "mixed" else logger.warning)("%s: %s", self.api.name, message)


# ---- memory and transfers --------------------------------------------------
def profiled_kv_budget(mod: Any, config, weights_bytes: int, profile: Callable[[], None],
                       name: str) -> int:
    """KV bytes = total * memory_utilization - (torch peak incl. weights + non-torch memory).

    `kv_cache_memory_bytes` wins when set (the profile still runs, to fail early).
    Non-torch memory is what the device reports used beyond torch's reserved
    pool at the profile's peak: context, library workspaces, other processes.
    """
    if config.cache.kv_cache_memory_bytes is not None:
        profile()
        return config.cache.kv_cache_memory_bytes
    gc.collect()
    mod.empty_cache()
    mod.reset_peak_memory_stats()
    before = mod.memory_allocated()
    profile()
    mod.synchronize()
    peak = mod.max_memory_allocated()
    free, total = mod.mem_get_info()
    non_torch = max(0, (total - free) - mod.memory_reserved())
    budget = int(total * config.cache.memory_utilization) - (peak + non_torch)
    logger.info("%s memory: total %.2f GiB x %.2f; weights %.2f GiB, other persistent %.2f GiB, "
                "profile peak increase %.2f GiB, non-torch %.2f GiB -> KV cache %.2f GiB", name,
                total / 2**30, config.cache.memory_utilization, weights_bytes / 2**30,
                max(0, before - weights_bytes) / 2**30, (peak - before) / 2**30,
                non_torch / 2**30, max(0, budget) / 2**30)
    mod.empty_cache()
    return max(0, budget)


def pinned_upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without blocking the host: staged through pinned memory."""
    if tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def async_to_host(mod: Any, tensor: torch.Tensor, stream: Any = None) -> HostFuture:
    """Copy into a pinned host buffer behind an event; `result()` waits on the event only.
    With `stream`, the copy runs there after the current stream's work."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    event = mod.Event()
    if stream is None:
        host.copy_(tensor, non_blocking=True)
        event.record()
        return HostFuture(host, wait=event.synchronize)
    stream.wait_stream(mod.current_stream())
    with mod.stream(stream):
        host.copy_(tensor, non_blocking=True)
        event.record(stream)
    tensor.record_stream(stream)

    def wait(keep=tensor) -> None:  # holds the device tensor until the copy is done
        event.synchronize()

    return HostFuture(host, wait=wait)
