"""Stream-graph machinery for backends whose device module follows the CUDA
API (graphs, memory pools, events, streams, memory statistics): the CUDA and
Ascend backends pass their device module or a small `GraphAPI`; nothing here
imports a device library.

- `graph_bucket_policy`: vLLM's capture sizes (`cudagraph_capture_sizes`: 1,
  2, 4, multiples of 8, then of 16 from 256, up to min(2 * max_num_seqs, 512)
  and max_num_batched_tokens), kept to those a decode-only batch can use
  (`decode_capture_sizes`: up to max_num_seqs, plus the one size above it), on
  both axes; a batch above the largest size runs unpadded (eager).
- `StaticGraphExecutor`: vLLM's FULL_DECODE_ONLY mode. Full-model graphs of
  uniform-decode steps keyed by the padded batch size alone, captured largest
  first into one shared pool, replayed after copying the step's inputs into
  static buffers; mixed and prefill steps run eagerly. Counters of replays and
  of eager steps by reason (`counters()`). With a length-adaptive attention
  (it reads `seq_lens` on the device, e.g. the Triton kernel) one graph serves
  every context length; otherwise the captured decode reads a fixed width, the
  block-table width capped at `max_seq_len_to_capture`, and longer contexts run
  eagerly.
- `profiled_kv_budget`, `async_to_host`, `pinned_upload`: memory profiling and
  host<->device transfers over a CUDA-like device module (uploads staged through
  a persistent pinned arena, `staging.py`); the profile also
  measures activation bytes per token, from which `StaticGraphExecutor`
  estimates the graph pool to reserve before the KV budget is fixed.
"""

from __future__ import annotations

import bisect
import functools
import gc
import inspect
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from polyrunner.attention.batched import STATIC_DECODE
from polyrunner.attention.metadata import AttentionMetadata
from polyrunner.device.backend import GraphExecutor, HostFuture, ModelInputs
from polyrunner.device.buckets import BucketPolicy, cudagraph_capture_sizes, decode_capture_sizes
from polyrunner.device.staging import PinnedStaging
from polyrunner.numeric import cdiv

if TYPE_CHECKING:
    from polyrunner.config import EngineConfig

logger = logging.getLogger(__name__)
MAX_CAPTURE_SIZE = 512

# Why a step ran eagerly (keys of `StaticGraphExecutor.counters()["eager"]`).
EAGER_REASONS = ("no_graphs", "mixed", "too_large", "not_captured", "long_context", "shape", "kv_caches")


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


def graph_token_sizes(config: EngineConfig) -> list[int]:
    """The token counts decode graphs are captured for under `config` (`runner.token_buckets`, else
    vLLM's decode capture sizes), whether or not enforce_eager turns graphs off."""
    sched = config.scheduler
    sizes = decode_capture_sizes(
        cudagraph_capture_sizes(sched.max_num_seqs, sched.max_num_batched_tokens, MAX_CAPTURE_SIZE),
        sched.max_num_seqs)
    return sorted(set(config.runner.token_buckets or sizes))


def graph_bucket_policy(config: EngineConfig, max_size: int | None = None) -> BucketPolicy:
    """Decode capture sizes (or `runner.token_buckets`/`request_buckets`); none under enforce_eager.
    `max_size`: the largest batch the backend's graphs can take (larger ones run unpadded)."""
    if config.runner.enforce_eager:
        return BucketPolicy()
    tokens = [t for t in graph_token_sizes(config) if max_size is None or t <= max_size]
    if not tokens:
        return BucketPolicy()
    reqs = sorted(set(config.runner.request_buckets or tokens))
    return GraphBucketPolicy(tokens, reqs)


# ---- graphs ----------------------------------------------------------------
class GraphAPI:
    """How a device captures and replays a graph. `capture(fn, pool)` runs
    `fn` under capture and returns `(replay, output)`; as with CUDA graphs, the
    output holds the step's result only after a `replay()` (a capture need not
    compute it)."""

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

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
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

        def z(t: torch.Tensor, n: int = B) -> torch.Tensor:
            return torch.zeros((n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)

        return cls(z(inputs.input_ids), z(inputs.positions), z(m.slot_mapping), z(m.seq_lens),
                   z(m.block_tables), z(m.query_start_loc, B + 1), z(m.token_to_req))

    def load(self, inputs: ModelInputs, B: int, W: int) -> None:
        """Copy a decode batch of B rows; its block table's first W columns (the rest stay 0)."""
        m = inputs.attn
        W = min(W, m.block_tables.shape[1])
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
    """FULL_DECODE_ONLY graphs over static buffers; eager otherwise.

    `prepare` captures one graph per token bucket B (B requests of one token
    each, B <= the largest decode size), largest first, all in one memory pool;
    each capture follows `num_warmups` eager runs. `run` replays graph B when the
    step is uniform decode, padded to a captured size, within the captured
    context width, and on the KV caches the graphs were captured with; anything
    else runs eagerly, counted by reason (`counters()`; logged once per reason).
    A failed capture discards every graph and the executor stays eager, with a
    warning saying why.

    `length_adaptive`: the backend's attention reads the lengths on the device
    (its cost follows `seq_lens`), so a graph may read the whole block table:
    one graph per batch size covers every context. Otherwise the graph's
    attention reads W = min(block-table width, max_seq_len_to_capture) blocks.
    """

    model: torch.nn.Module
    api: GraphAPI
    max_num_seqs: int
    enforce_eager: bool = False
    num_warmups: int = 1
    length_adaptive: bool = False
    max_seq_len_to_capture: int = 8192
    graphs: dict[int, _Graph] = field(default_factory=dict)
    capture_seconds: float = 0.0
    capture_bytes: int = 0
    reserved_bytes: int = 0  # the pool estimate the KV budget left free (pool_reserve_bytes)
    disabled_reason: str | None = None
    replays: int = 0
    eager_steps: Counter[str] = field(default_factory=Counter)
    _static: _Static | None = None
    _kv: list[torch.Tensor] | None = None
    _kv_ptrs: list[int] = field(default_factory=list)
    _width: int = 0          # blocks a graph's attention reads per request
    _block_size: int = 0
    _capturing: int | None = None
    _pool: Any = None
    _warned: set[str] = field(default_factory=set)

    def prepare(self, run_dummy: Callable[[int, int], Any], buckets: BucketPolicy) -> None:
        if self.enforce_eager:
            logger.info("%s: enforce_eager is set; no graphs are captured", self.api.name)
            return
        sizes = [b for b in buckets.token_buckets if buckets.pad(b, b) == (b, b)]
        if not sizes:
            return
        logger.info("%s: capturing %d decode graphs (batch sizes %s)", self.api.name, len(sizes), sizes)
        t0, free0 = time.perf_counter(), self.api.free_memory()
        self._pool = self.api.pool()
        gc.freeze()   # the heap so far is long-lived: no collection rescans it during captures (vLLM does so too)
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
            gc.unfreeze()
            self.api.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free0 - self.api.free_memory())
        self.replays, self.eager_steps = 0, Counter()  # count serving steps only
        logger.info("%s: captured %d decode graphs (batch sizes %s, context width %d tokens%s) in %.2fs using "
                    "%.1f MiB (reserved %.1f MiB)", self.api.name, len(self.graphs), sorted(self.graphs),
                    self._width * self._block_size, ", length-adaptive" if self.length_adaptive else "",
                    self.capture_seconds, self.capture_bytes / 2**20, self.reserved_bytes / 2**20)
        if self.reserved_bytes and self.capture_bytes > self.reserved_bytes:
            logger.warning("%s: the graph pool (%.1f MiB) outgrew its reserve (%.1f MiB); lower "
                           "gpu_memory_utilization if memory runs short", self.api.name,
                           self.capture_bytes / 2**20, self.reserved_bytes / 2**20)

    def num_graphs(self) -> int:
        return len(self.graphs)

    def counters(self) -> dict[str, Any]:
        """{"replays": n, "eager": {reason: n}, "graphs": sizes}: steps since start-up (warm-up excluded)."""
        return {"replays": self.replays, "eager": dict(self.eager_steps), "graphs": sorted(self.graphs)}

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        if self._capturing is not None:
            return self._capture(inputs, self._capturing)
        B = self._dispatch(inputs)
        if B is None:
            hidden: torch.Tensor = self.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches)
            return hidden
        assert self._static is not None
        self._static.load(inputs, B, self._width)
        graph = self.graphs[B]
        graph.replay()
        self.replays += 1
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
            table = m.block_tables.shape[1]
            self._width = table if self.length_adaptive else min(table, cdiv(self.max_seq_len_to_capture, bs))
        st, kv, W = self._static, self._kv, self._width
        st.load(inputs, B, W)
        meta = st.meta(B, W, self._block_size)

        def forward() -> torch.Tensor:
            hidden: torch.Tensor = self.model(st.input_ids[:B], st.positions[:B], meta, kv)
            return hidden

        for _ in range(self.num_warmups):
            forward()
        self.api.synchronize()
        replay, out = self.api.capture(forward, self._pool)
        self.graphs[B] = _Graph(replay, out)
        return out

    def _dispatch(self, inputs: ModelInputs) -> int | None:
        """The graph to replay for this step, or None (eager, counted by reason)."""
        reason, message = self._eager_reason(inputs)
        if reason is None:
            return int(inputs.input_ids.shape[0])
        self.eager_steps[reason] += 1
        if reason not in self._warned and message:
            self._warned.add(reason)
            (logger.info if reason in ("mixed", "no_graphs") else logger.warning)("%s: %s", self.api.name, message)
        return None

    def _eager_reason(self, inputs: ModelInputs) -> tuple[str | None, str]:
        if not self.graphs:
            return "no_graphs", ""
        m = inputs.attn
        B = inputs.input_ids.shape[0]
        if m.max_query_len != 1 or m.num_actual_tokens != m.num_reqs:
            return "mixed", "steps with prefill tokens run eagerly (graphs are decode-only)"
        if B not in self.graphs:
            largest = max(self.graphs)
            if B > largest:
                return "too_large", f"decode batch of {B} exceeds the largest captured graph ({largest}); eager"
            return "not_captured", f"no graph was captured for padded size {B}; running eagerly"
        if m.max_seq_len > self._width * self._block_size:
            return "long_context", (f"decode context of {m.max_seq_len} tokens exceeds the graphs' width "
                                    f"({self._width * self._block_size}, max_seq_len_to_capture="
                                    f"{self.max_seq_len_to_capture}); running eagerly")
        if m.num_padded_reqs != B:
            return "shape", f"batch padded to {m.num_padded_reqs} requests for {B} tokens; running eagerly"
        if inputs.kv_caches is not self._kv and [t.data_ptr() for t in inputs.kv_caches] != self._kv_ptrs:
            return "kv_caches", "KV caches differ from those the graphs were captured with; running eagerly"
        return None, ""

    # ---- memory ----------------------------------------------------------------
    def pool_reserve_bytes(self, activation_bytes_per_token: float, buckets: BucketPolicy) -> int:
        """An estimate of the graph pool, reserved before the KV budget is fixed: the
        largest graph's activations (one pool, captured largest first, so smaller
        graphs reuse them) at the profile's bytes per token, plus 2 MiB per graph
        for outputs and allocator rounding. 0 under enforce_eager."""
        sizes = [b for b in buckets.token_buckets if buckets.pad(b, b) == (b, b)]
        if self.enforce_eager or not sizes:
            return 0
        self.reserved_bytes = int(activation_bytes_per_token * sizes[-1]) + len(sizes) * (2 << 20)
        return self.reserved_bytes


# ---- memory and transfers --------------------------------------------------
def worst_case_profile(profile: Callable[..., None]) -> Callable[[], None]:
    """The runner's profile asked for its worst steps (`profile(worst_case=True)`:
    also the longest prefill and the sampler at max_num_seqs); a plain callable
    (a check's stand-in) is called as it is."""
    try:
        accepts = "worst_case" in inspect.signature(profile).parameters
    except (TypeError, ValueError):
        accepts = False
    return (lambda: profile(worst_case=True)) if accepts else profile


def profiled_kv_budget(mod: Any, config: EngineConfig, weights_bytes: int, profile: Callable[[], None],
                       name: str, reserve: Callable[[float], int] | None = None) -> int:
    """KV bytes = total * memory_utilization - (torch peak incl. weights + non-torch memory
    + reserve), where `profile()` runs the engine's worst steps (the largest batch, the
    longest prefill, the sampler at max_num_seqs).

    `reserve(activation_bytes_per_token)` -> bytes kept free for what is allocated
    after the KV cache (the graph pool: `StaticGraphExecutor.pool_reserve_bytes`);
    bytes per token = the profile's peak increase / max_num_batched_tokens.
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
    per_token = (peak - before) / max(1, config.scheduler.max_num_batched_tokens)
    reserved = reserve(per_token) if reserve is not None else 0
    budget: int = int(total * config.cache.memory_utilization) - (peak + non_torch + reserved)
    logger.info("%s memory: total %.2f GiB x %.2f; weights %.2f GiB, other persistent %.2f GiB, "
                "profile peak increase %.2f GiB, non-torch %.2f GiB, graph pool reserve %.2f GiB "
                "-> KV cache %.2f GiB", name,
                total / 2**30, config.cache.memory_utilization, weights_bytes / 2**30,
                max(0, before - weights_bytes) / 2**30, (peak - before) / 2**30,
                non_torch / 2**30, reserved / 2**30, max(0, budget) / 2**30)
    mod.empty_cache()
    return max(0, budget)


@functools.lru_cache(maxsize=None)
def _staging(device: torch.device) -> PinnedStaging:
    return PinnedStaging(torch.get_device_module(device), device)


def pinned_upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without blocking the host: staged through the device's one
    persistent pinned arena (`PinnedStaging`; nothing is pinned per call)."""
    return _staging(torch.device(device)).upload(tensor)


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

    def wait(keep: torch.Tensor = tensor) -> None:  # holds the device tensor until the copy is done
        event.synchronize()

    return HostFuture(host, wait=wait)
