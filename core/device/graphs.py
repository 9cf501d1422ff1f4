"""Stream-graph machinery for backends whose device module follows the CUDA
API (graphs, memory pools, events, streams, memory statistics): the CUDA and
Ascend backends pass their device module or a small `GraphAPI`; nothing here
imports a device library.

- Modes and padding (`graph_buckets.py`, vLLM's `CUDAGraphMode` names):
  FULL_DECODE_ONLY, FULL, NONE; `graph_bucket_policy` pads to vLLM's capture
  sizes (`cudagraph_capture_sizes`), decode steps to the decode sizes (up to
  max_num_seqs, plus the one size above it) and, under FULL, mixed steps' tokens
  to the mixed sizes (up to min(max_num_batched_tokens, 512)) and their requests
  to that graph's R; a batch above the largest size runs unpadded (eager).
- `StaticGraphExecutor`: full-model graphs over static buffers
  (`graph_static.py`), captured largest first into one shared pool, replayed
  after copying the step's inputs in. FULL_DECODE_ONLY: decode graphs keyed by
  the padded batch size; FULL: also mixed graphs keyed by the padded token count
  (needs a length-adaptive attention, else it falls back to FULL_DECODE_ONLY).
  Every capture runs under the capture guard (`capture_guard.py`): a host sync in
  the step fails the capture with `HostSyncError`, on the CPU as on the device.
  Fallback order FULL -> FULL_DECODE_ONLY -> eager per step, counted by reason
  (`counters()`). A failed capture is a RuntimeError (run with enforce_eager /
  cudagraph_mode="NONE" to have no graphs). With a length-adaptive attention
  (it reads `seq_lens` on the device, e.g. the Triton kernel) one graph serves
  every context length; otherwise a decode graph reads a fixed width, the
  block-table width capped at `max_seq_len_to_capture`, and longer contexts run
  eagerly.
- `profiled_kv_budget`, `async_to_host`, `pinned_upload`: memory profiling and
  host<->device transfers over a CUDA-like device module (uploads staged through
  a persistent pinned arena, `staging.py`); the profile also
  measures activation bytes per token, from which `StaticGraphExecutor`
  estimates the graph pool to reserve before the KV budget is fixed.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from polyrunner.device.backend import GraphExecutor, HostFuture, ModelInputs
from polyrunner.device.buckets import BucketPolicy
from polyrunner.device.capture_guard import HostSyncError, capture_guard
from polyrunner.device.graph_buckets import (
    FULL,
    FULL_DECODE_ONLY,
    GRAPH_MODES,
    MAX_CAPTURE_SIZE,
    NONE,
    FullGraphBucketPolicy,
    GraphBucketPolicy,
    graph_bucket_policy,
    graph_token_sizes,
    mixed_token_sizes,
    requested_graph_mode,
    resolve_graph_mode,
)
from polyrunner.device.graph_static import StaticBuffers
from polyrunner.device.staging import PinnedStaging
from polyrunner.numeric import cdiv

if TYPE_CHECKING:
    from polyrunner.config import EngineConfig

__all__ = [
    "EAGER_REASONS", "FULL", "FULL_DECODE_ONLY", "GRAPH_MODES", "MAX_CAPTURE_SIZE", "NONE", "FullGraphBucketPolicy",
    "GraphAPI", "GraphBucketPolicy", "StaticGraphExecutor", "TorchGraphAPI", "async_to_host", "graph_bucket_policy",
    "graph_token_sizes", "mixed_token_sizes", "pinned_upload", "profiled_kv_budget", "requested_graph_mode",
    "resolve_graph_mode", "worst_case_profile",
]

logger = logging.getLogger(__name__)

# Why a step ran eagerly (keys of `StaticGraphExecutor.counters()["eager"]`).
EAGER_REASONS = ("no_graphs", "mixed", "too_large", "not_captured", "long_context", "shape", "kv_caches")
DECODE, MIXED = "decode", "mixed"   # the two kinds of graph
GraphKey = tuple[str, int]          # (kind, padded token count)


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
class _Graph:
    replay: Callable[[], None]
    output: torch.Tensor
    reqs: int = 0   # padded requests (a mixed graph's R)


@dataclass
class StaticGraphExecutor(GraphExecutor):
    """Full-model graphs over static buffers (`mode`, vLLM's names); eager otherwise.

    `prepare` captures, largest first and all in one memory pool, one decode
    graph per decode bucket B (B requests of one token each) and, under FULL,
    one mixed graph per mixed size T (T tokens, R = `mixed_reqs(T)` requests);
    each capture follows `num_warmups` eager runs. `run` replays decode graph B
    for a uniform-decode step padded to (B, B) within the captured context width,
    and (FULL) mixed graph T for any other step padded to (T, R); both only on
    the KV caches the graphs were captured with. Anything else runs eagerly,
    counted by reason (`counters()`; logged once per reason). A failed capture
    raises RuntimeError (what, at which size, how to avoid it).

    `mode`: FULL_DECODE_ONLY (default), FULL (falls back to FULL_DECODE_ONLY,
    with `fallback_reason` logged, unless `length_adaptive`) or NONE (no graphs;
    so is `enforce_eager=True`).

    `length_adaptive`: the backend's attention reads the lengths on the device
    (its cost follows `seq_lens`), so a graph may read the whole block table:
    one graph per batch size covers every context. Otherwise a decode graph's
    attention reads W = min(block-table width, max_seq_len_to_capture) blocks.
    """

    model: torch.nn.Module
    api: GraphAPI
    max_num_seqs: int
    enforce_eager: bool = False
    num_warmups: int = 1
    length_adaptive: bool = False
    max_seq_len_to_capture: int = 8192
    mode: str = FULL_DECODE_ONLY
    graphs: dict[int, _Graph] = field(default_factory=dict)        # decode graphs by batch size
    mixed_graphs: dict[int, _Graph] = field(default_factory=dict)  # mixed graphs by token count
    capture_seconds: float = 0.0
    capture_bytes: int = 0
    reserved_bytes: int = 0  # the pool estimate the KV budget left free (pool_reserve_bytes)
    fallback_reason: str | None = None   # why `mode` is not the mode asked for
    replays: int = 0
    mixed_replays: int = 0
    eager_steps: Counter[str] = field(default_factory=Counter)
    _static: StaticBuffers | None = None
    _kv: list[torch.Tensor] | None = None
    _kv_ptrs: list[int] = field(default_factory=list)
    _width: int = 0          # blocks a graph's attention reads per request
    _block_size: int = 0
    _capturing: tuple[str, int, int] | None = None   # (kind, tokens, requests)
    _static_shape: tuple[int, int] = (0, 0)          # the largest graph's (tokens, requests)
    _pool: Any = None
    _warned: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        asked = NONE if self.enforce_eager else self.mode
        self.mode, self.fallback_reason = resolve_graph_mode(asked, self.length_adaptive)
        self.enforce_eager = self.mode == NONE
        if self.fallback_reason:
            logger.warning("%s: %s", self.api.name, self.fallback_reason)

    def capture_plan(self, buckets: BucketPolicy) -> list[tuple[str, int, int]]:
        """(kind, tokens, requests) of every graph `prepare` captures, largest first:
        decode graphs at the buckets that pad (B, B) to themselves, and under FULL
        mixed graphs at the policy's mixed sizes (a `FullGraphBucketPolicy`)."""
        if self.mode == NONE or self.enforce_eager:
            return []
        full = buckets if isinstance(buckets, FullGraphBucketPolicy) else None
        decode = full.decode_sizes if full is not None else buckets.token_buckets
        plan = [(DECODE, b, b) for b in decode if buckets.pad(b, b) == (b, b)]
        if self.mode == FULL and full is not None:
            plan += [(MIXED, t, full.mixed_reqs(t)) for t in full.mixed_sizes]
        return sorted(plan, key=lambda p: (p[1], p[0] == MIXED), reverse=True)

    def prepare(self, run_dummy: Callable[[int, int], Any], buckets: BucketPolicy) -> None:
        if self.mode == NONE or self.enforce_eager:
            logger.info("%s: enforce_eager / cudagraph_mode NONE: no graphs are captured", self.api.name)
            return
        plan = self.capture_plan(buckets)
        if not plan:
            return
        logger.info("%s: capturing %d graphs (%s; token counts %s)", self.api.name, len(plan), self.mode,
                    sorted({t for _, t, _ in plan}))
        t0, free0 = time.perf_counter(), self.api.free_memory()
        self._static_shape = (max(t for _, t, _ in plan), max(r for *_, r in plan))
        self._pool = self.api.pool()
        gc.freeze()   # the heap so far is long-lived: no collection rescans it during captures (vLLM does so too)
        kind, T, R = plan[0]
        try:
            for kind, T, R in plan:  # largest first: smaller graphs reuse its pool
                self._capturing = (kind, T, R)
                run_dummy(T, R)
        except Exception as exc:
            self.graphs.clear()
            self.mixed_graphs.clear()
            self._static = self._pool = None
            if isinstance(exc, HostSyncError):   # a bug in the step's code, not a resource limit
                raise HostSyncError(f"{self.api.name}: capturing the {kind} graph for {T} tokens ({R} requests) "
                                    f"failed: {exc}. To run without graphs pass enforce_eager=True") from exc
            raise RuntimeError(
                f"{self.api.name}: capturing the {kind} graph for {T} tokens ({R} requests) failed: "
                f"{self.api.explain(exc)}. To run without graphs pass enforce_eager=True (or "
                f"cudagraph_mode=\"NONE\"); if the device ran out of memory, lower gpu_memory_utilization "
                f"(or set cudagraph_mode=\"FULL_DECODE_ONLY\" to capture fewer graphs)") from exc
        finally:
            self._capturing = None
            gc.unfreeze()
            self.api.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free0 - self.api.free_memory())
        self.replays, self.mixed_replays, self.eager_steps = 0, 0, Counter()  # count serving steps only
        logger.info("%s: %s: captured %d decode graphs (batch sizes %s) and %d mixed graphs (token counts %s), "
                    "context width %d tokens%s, in %.2fs using %.1f MiB (reserved %.1f MiB)", self.api.name,
                    self.mode, len(self.graphs), sorted(self.graphs), len(self.mixed_graphs),
                    sorted(self.mixed_graphs), self._width * self._block_size,
                    ", length-adaptive" if self.length_adaptive else "",
                    self.capture_seconds, self.capture_bytes / 2**20, self.reserved_bytes / 2**20)
        if self.reserved_bytes and self.capture_bytes > self.reserved_bytes:
            logger.warning("%s: the graph pool (%.1f MiB) outgrew its reserve (%.1f MiB); lower "
                           "gpu_memory_utilization if memory runs short", self.api.name,
                           self.capture_bytes / 2**20, self.reserved_bytes / 2**20)

    def num_graphs(self) -> int:
        return len(self.graphs) + len(self.mixed_graphs)

    def counters(self) -> dict[str, Any]:
        """Steps since start-up (warm-up excluded): {"mode", "replays" (every graph),
        "mixed_replays", "eager": {reason: n}, "graphs": decode sizes, "mixed_graphs": token counts}."""
        return {"mode": self.mode, "replays": self.replays, "mixed_replays": self.mixed_replays,
                "eager": dict(self.eager_steps), "graphs": sorted(self.graphs),
                "mixed_graphs": sorted(self.mixed_graphs)}

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        if self._capturing is not None:
            return self._capture(inputs, *self._capturing)
        key = self._dispatch(inputs)
        if key is None:
            hidden: torch.Tensor = self.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches)
            return hidden
        assert self._static is not None
        kind, T = key
        graph = self.graphs[T] if kind == DECODE else self.mixed_graphs[T]
        self._static.load(inputs, T, graph.reqs, self._width)
        self.before_replay(kind, T, inputs)
        graph.replay()
        self.replays += 1
        self.mixed_replays += kind == MIXED
        return graph.output

    def before_replay(self, kind: str, T: int, inputs: ModelInputs) -> None:
        """Hook, after the step is copied into the static buffers and before graph (kind, T)
        replays: update what the graph took from the host at capture (e.g. an attention op's
        host sequence lengths). Default: nothing."""

    def _capture(self, inputs: ModelInputs, kind: str, T: int, R: int) -> torch.Tensor:
        m = inputs.attn
        if (inputs.input_ids.shape[0] != T or m.num_padded_reqs != R
                or (kind == DECODE and m.max_query_len != 1)):
            raise RuntimeError(f"capture of the {kind} graph ({T} tokens, {R} requests) got a batch of "
                               f"{inputs.input_ids.shape[0]} tokens, {m.num_padded_reqs} requests, "
                               f"max_query_len {m.max_query_len}")
        if self._static is None:  # the first (largest) capture sizes the static buffers
            self._static = StaticBuffers.like(inputs, *self._static_shape)
            self._kv, self._kv_ptrs = inputs.kv_caches, [t.data_ptr() for t in inputs.kv_caches]
            self._block_size = bs = inputs.kv_caches[0].shape[2]
            table = m.block_tables.shape[1]
            self._width = table if self.length_adaptive else min(table, cdiv(self.max_seq_len_to_capture, bs))
        st, kv, W = self._static, self._kv, self._width
        st.load(inputs, T, R, W)
        meta = st.decode_meta(T, W, self._block_size) if kind == DECODE else st.mixed_meta(T, R, W, self._block_size)

        def forward() -> torch.Tensor:
            hidden: torch.Tensor = self.model(st.input_ids[:T], st.positions[:T], meta, kv)
            return hidden

        for _ in range(self.num_warmups):
            forward()
        self.api.synchronize()
        with capture_guard(st.input_ids.device):   # no host sync may reach the graph (capture_guard.py)
            replay, out = self.api.capture(forward, self._pool)
        (self.graphs if kind == DECODE else self.mixed_graphs)[T] = _Graph(replay, out, R)
        return out

    def _dispatch(self, inputs: ModelInputs) -> GraphKey | None:
        """The graph to replay for this step, (kind, padded tokens), or None (eager, counted by reason)."""
        key, reason, message = self._choose(inputs)
        if key is not None:
            return key
        self.eager_steps[reason] += 1
        if reason not in self._warned and message:
            self._warned.add(reason)
            (logger.info if reason in ("mixed", "no_graphs") else logger.warning)("%s: %s", self.api.name, message)
        return None

    def _choose(self, inputs: ModelInputs) -> tuple[GraphKey | None, str, str]:
        """(graph key, "", "") or (None, eager reason, message)."""
        if not self.graphs and not self.mixed_graphs:
            return None, "no_graphs", ""
        m = inputs.attn
        T = int(inputs.input_ids.shape[0])
        decode = m.max_query_len == 1 and m.num_actual_tokens == m.num_reqs
        if decode and (T in self.graphs or not self.mixed_graphs):
            reason, message = self._decode_reason(inputs, T)
            return ((DECODE, T) if reason is None else None), reason or "", message
        if not self.mixed_graphs:
            why = f" ({self.fallback_reason})" if self.fallback_reason else ""
            return None, "mixed", f"steps with prefill tokens run eagerly (graphs are decode-only{why})"
        if T not in self.mixed_graphs:
            largest = max(self.mixed_graphs)
            if T > largest:
                return None, "too_large", (f"a step of {T} tokens exceeds the largest mixed graph ({largest} "
                                           "tokens); running eagerly")
            return None, "not_captured", f"no mixed graph was captured for {T} padded tokens; running eagerly"
        R = self.mixed_graphs[T].reqs
        if m.num_padded_reqs != R:
            return None, "shape", (f"step of {T} tokens padded to {m.num_padded_reqs} requests, its graph has "
                                   f"{R}; running eagerly")
        if not self._same_kv(inputs):
            return None, "kv_caches", "KV caches differ from those the graphs were captured with; running eagerly"
        return (MIXED, T), "", ""

    def _decode_reason(self, inputs: ModelInputs, B: int) -> tuple[str | None, str]:
        m = inputs.attn
        if B not in self.graphs:
            largest = max(self.graphs, default=0)
            if B > largest:
                return "too_large", f"decode batch of {B} exceeds the largest captured graph ({largest}); eager"
            return "not_captured", f"no graph was captured for padded size {B}; running eagerly"
        if m.max_seq_len > self._width * self._block_size:
            return "long_context", (f"decode context of {m.max_seq_len} tokens exceeds the graphs' width "
                                    f"({self._width * self._block_size}, max_seq_len_to_capture="
                                    f"{self.max_seq_len_to_capture}); running eagerly")
        if m.num_padded_reqs != B:
            return "shape", f"batch padded to {m.num_padded_reqs} requests for {B} tokens; running eagerly"
        if not self._same_kv(inputs):
            return "kv_caches", "KV caches differ from those the graphs were captured with; running eagerly"
        return None, ""

    def _same_kv(self, inputs: ModelInputs) -> bool:
        return inputs.kv_caches is self._kv or [t.data_ptr() for t in inputs.kv_caches] == self._kv_ptrs

    # ---- memory ----------------------------------------------------------------
    def pool_reserve_bytes(self, activation_bytes_per_token: float, buckets: BucketPolicy) -> int:
        """An estimate of the graph pool, reserved before the KV budget is fixed: the
        largest graph's activations (one pool, captured largest first, so smaller
        graphs reuse them) at the profile's bytes per token, plus 2 MiB per graph
        for outputs and allocator rounding. 0 under enforce_eager / NONE."""
        plan = self.capture_plan(buckets)
        if not plan:
            return 0
        self.reserved_bytes = int(activation_bytes_per_token * plan[0][1]) + len(plan) * (2 << 20)
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
