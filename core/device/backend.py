"""The backend contract: what a device plugin supplies to the core.

A backend is a `Backend` subclass contributed through the
`polyrunner_backends` hook. The base class implements every member for a plain
torch device (eager, unpadded, reference attention, blocking transfers), so a
plugin overrides only what its device does differently. Each member's
docstring says whether it is REQUIRED or OPTIONAL, when the core calls it, and
what it must keep true, like pytest's hookspecs.

Two lifetimes, like ggml-backend's registry and backend:

- the class, before any engine exists, stateless: `name`, `priority`,
  `capabilities`, `probe()`, `device_count()` (discovery, `polyrunner
  backends`, `LLM(backend=...)`), `default_limits(usage)` (defaults of the
  scheduler limits the user left unset) and `adjust_config(config)` (this
  backend's changes to the validated config, before anything is built from it);
- the instance, one per engine (and per tensor-parallel rank), made as
  `cls(config)` from the adjusted config and owning everything the engine's
  device work keeps: its executor (`self.executor`, set by the core from
  `make_executor`), graphs, pools. No member reads state another member left
  behind, except what the contract names: `self.config`, `self.executor`, and
  what `init_rank` changed for `leave_rank`.

Engine start-up calls, in this order: `default_limits`, `adjust_config`, `cls(config)`,
`init_rank` (tensor parallelism), `resolve_dtype` (dtype "auto" only) and `check_dtype`; `device`
(the model is loaded there); `op_overrides` (its factories replace the model's
modules); `make_executor`; `bucket_policy` (after the executor: a policy may
depend on what the executor made); `kv_cache_budget` (runs one max-size dummy
step) and `num_kv_blocks`; `allocate_kv_cache`;
`GraphExecutor.prepare` (capture / compile / warm up every bucket). Each step:
`host_attention_extras`, `to_device` (every input array), `no_grad`,
`GraphExecutor.run` (the model calls `attention` once per layer, also inside
graph capture), `GraphExecutor.compute_logits`, `GraphExecutor.sample`,
`to_host_async`; `make_generator` once per new seeded request.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, cast

import numpy as np
import torch

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import reference_paged_attention
from polyrunner.device.buckets import BucketPolicy
from polyrunner.device.kv_spec import KVCacheSpec
from polyrunner.sample import Sampler, SamplerOutput, SamplingMetadata

if TYPE_CHECKING:
    from polyrunner.config import EngineConfig, UsageContext
    from polyrunner.runner.inputs import StepInputs

_SAMPLER = Sampler()

# Sampling features a backend may or may not run on its device. "logprobs" is the
# default `logprobs_mode` (raw logprobs); "raw_logits", "processed_logprobs" and
# "processed_logits" are the other modes; "logits_processors" runs per-request Python
# callables on each sampled logits row (the core sampler does).
SAMPLING_FEATURES = frozenset({
    "temperature", "top_k", "top_p", "min_p", "penalties", "logit_bias",
    "allowed_token_ids", "bad_words", "seed", "logprobs", "prompt_logprobs",
    "raw_logits", "processed_logprobs", "processed_logits", "logits_processors",
    "structured_outputs",
})

# Attention features a model may need of `Backend.attention` (`LayerSpec` fields): per-layer
# "sliding_window" and "logits_soft_cap" (scores become cap * tanh(scores / cap), Gemma 2).
ATTENTION_FEATURES = frozenset({"sliding_window", "logits_soft_cap"})


@dataclass(frozen=True)
class Availability:
    """Result of a probe: usable or not, why not (or a note when usable), which device,
    and the command that fixes what `reason` names (`fix`, shown by `polyrunner backends`)."""

    available: bool
    reason: str = ""
    device: str = ""
    fix: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares about itself (OPTIONAL: the defaults describe an
    eager device that runs every dtype and sampling feature). Read at start-up
    and by the conformance suite, which excuses checks a capability rules out.

    graph_mode: "eager", "torch_compile", "cuda_graph", "xla", "acl_graph", "cpu_graph" (shown
      by `polyrunner backends`).
    static_shapes: every step must be padded to a bucket (tokens and requests);
      `bucket_policy` must then cover every legal batch of the config (adjust
      max_num_seqs in `Backend.adjust_config` if a kernel caps requests).
    counts_graphs: `GraphExecutor.num_graphs()` is meaningful (no-recompile checks).
    dtypes: the dtypes `check_dtype` accepts.
    sampling: sampling features the device supports; the engine rejects a request
      that needs another one with an error naming it.
    async_scheduling: `to_host_async` returns a future that completes later (the
      copy queues behind the device's work), so the engine may schedule and prepare
      step N+1 while step N runs, feeding N's sampled tokens to N+1 on the device.
      The engine's default when `async_scheduling` is not configured (vLLM's name).
    distributed_backend: the torch.distributed backend its ranks talk over for
      tensor parallelism ("gloo", "nccl", "hccl"); None refuses
      tensor_parallel_size > 1.
    spmd: the backend shards one program over its devices itself (XLA SPMD): the
      engine runs one process with the whole model for any tensor_parallel_size,
      and the backend annotates the sharding (no ranks, no distributed_backend).
    attention_features: the `ATTENTION_FEATURES` its attention honours; the engine
      refuses at start a model whose layers need another one, naming it.
    ray_device_key: the Ray resource one rank's device is (vLLM's name: "GPU", "NPU");
      `distributed_executor_backend="ray"` places each rank in a bundle of one; None: a
      rank is a CPU (a bundle of one "CPU").
    """

    graph_mode: str = "eager"
    static_shapes: bool = False
    counts_graphs: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    sampling: frozenset[str] = SAMPLING_FEATURES
    async_scheduling: bool = False
    distributed_backend: str | None = None
    attention_features: frozenset[str] = ATTENTION_FEATURES
    spmd: bool = False
    ray_device_key: str | None = None


@dataclass
class ModelInputs:
    """One padded step, on the device: what the model forward consumes."""

    input_ids: torch.Tensor        # [T_pad] int64
    positions: torch.Tensor        # [T_pad] int64
    attn: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer
    logits_indices: torch.Tensor   # [R_pad] int64: rows of the hidden states to sample


def model_compute_logits(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's `compute_logits(hidden) -> logits` (torch types a module's other attributes as
    `Tensor | Module`)."""
    return cast(Callable[[torch.Tensor], torch.Tensor], model.compute_logits)


class GraphExecutor:
    """Runs the model on padded batches; the base class runs eagerly. Made once
    per engine by `Backend.make_executor`; a backend whose device captures or
    compiles graphs subclasses it (see `polyrunner.device.graphs`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def prepare(self, run_dummy: Callable[[int, int], Any], buckets: BucketPolicy) -> None:
        """OPTIONAL; once at start-up, after the KV cache is allocated. Capture,
        compile or warm up every bucket by calling `run_dummy(num_tokens,
        num_reqs)`, which pads a dummy batch to that bucket (its tokens write only
        the null block) and calls `self.run` on it. After `prepare`, serving must
        not compile or capture anything new (the conformance suite checks
        `num_graphs`). A failed capture raises RuntimeError saying what failed, at
        which size, and how to run without graphs (as vLLM does: no silent eager)."""
        return None

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """OPTIONAL; each step, under `Backend.no_grad()`. The final hidden states
        `[T_pad, hidden]` of the padded batch; they must equal eager execution of
        the same batch (rows of padded tokens are ignored)."""
        hidden: torch.Tensor = self.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches)
        return hidden

    def num_graphs(self) -> int | None:
        """OPTIONAL; read by checks and benchmarks. Graphs compiled or captured so
        far; None when the backend does not count (`Capabilities.counts_graphs`)."""
        return None

    def kernel_report(self) -> str | None:
        """OPTIONAL; read by `polyrunner bench --workload kernels`. A table of the kernels this
        executor chose for the model (and what it measured to choose them); None when it chose none."""
        return None

    @staticmethod
    def logit_rows(hidden: torch.Tensor, inputs: ModelInputs, R: int) -> torch.Tensor:
        """The hidden rows of the first R requests' last tokens (`inputs.logits_indices[:R]`);
        `hidden` itself when it has exactly R rows (one token each, already in order)."""
        return hidden if hidden.shape[0] == R else hidden[inputs.logits_indices[:R]]

    def compute_logits(self, hidden: torch.Tensor, inputs: ModelInputs, num_reqs: int) -> torch.Tensor:
        """OPTIONAL; each step, after `run`. Float logits `[>= num_reqs, V]` of the step's
        sampled rows: row i < num_reqs belongs to batch row i (hidden row
        `inputs.logits_indices[i]`). A static-shape executor may return all
        `R_pad` padded rows (the extra rows are ignored)."""
        return model_compute_logits(self.model)(self.logit_rows(hidden, inputs, num_reqs))

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """OPTIONAL; each step, after `compute_logits`. One token per row (and the
        requested logprobs) from `logits` and the step's `SamplingMetadata`. The
        default runs the core sampler on the first `meta.num_reqs` rows; a
        static-shape backend may override it with its own on-device function over
        the padded logits (it must honour every feature its `Capabilities.sampling`
        declares). Rows past `meta.num_reqs` in the result are ignored."""
        return _SAMPLER(logits[:meta.num_reqs], meta)


@dataclass
class HostFuture:
    """A device->host copy in flight; `result()` waits and returns the host tensor."""

    tensor: torch.Tensor
    wait: Callable[[], None] = field(default=lambda: None)

    def result(self) -> torch.Tensor:
        self.wait()
        return self.tensor


class Backend:
    """Base backend: a plain torch device, eager, unpadded. Override per device.

    REQUIRED: `name`, `probe`, `device`, `memory_info` (unless every config sets
    kv_cache_memory_bytes). Everything else is OPTIONAL. Class members serve
    discovery and configuration before an engine exists; one instance, made
    with `cls(config)` after a successful probe and `adjust_config`, serves one
    engine (the conformance suite makes many: keep `__init__` cheap, and call
    `super().__init__(config)` in an override).

    name: REQUIRED, unique across plugins; what `backend=` selects.
    priority: OPTIONAL; without `backend=`, the available backend with the
      highest priority runs (cpu 0, xla 20, npu 90, cuda 100).
    capabilities: OPTIONAL, see `Capabilities`.
    kv_alignment_bytes: OPTIONAL; each layer's KV allocation is a multiple of
      this (e.g. Ascend's 2 MiB); `num_kv_blocks` budgets with it.
    device_libraries: OPTIONAL; the distributions the backend runs on, which the
      conformance certificate records with their versions (default: the requirements
      of the plugin distribution's extra named after the backend).
    """

    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0
    capabilities: ClassVar[Capabilities] = Capabilities()
    kv_alignment_bytes: ClassVar[int] = 1
    device_libraries: ClassVar[tuple[str, ...]] = ()
    # vLLM's name: checkpoint quantization formats `quantize_model` executes (e.g. "gguf")
    supported_quantization: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: "EngineConfig") -> None:
        self.config = config   # the engine's final (adjusted) configuration
        # The engine's executor: set by the core to what `make_executor` returned, before it
        # calls any later member (`bucket_policy`, `kv_cache_budget`, ...); None until then.
        self.executor: GraphExecutor | None = None

    # ---- identity and configuration (class level: no engine yet) --------
    @classmethod
    def probe(cls) -> Availability:
        """REQUIRED; at discovery and selection, on the class. Is the device usable
        here? Never raises; imports the device library only here, and a missing
        library or device is `Availability(False, reason)`."""
        return Availability(False, "abstract base backend")

    @classmethod
    def device_count(cls) -> int:
        """OPTIONAL. How many devices of this kind this host has (the most
        tensor-parallel ranks it can place, one per device); default 1."""
        return 1

    @classmethod
    def adjust_config(cls, config: "EngineConfig") -> None:
        """OPTIONAL; once per engine, on the class, after selection and before the instance
        is made (the conformance suite also calls it for each configuration it builds).
        Adjust the validated `config` in place for this backend (e.g. force the block size its
        kernel needs, cap max_num_seqs at what a kernel takes); raise ValueError to refuse a
        configuration it cannot run. Default: nothing."""

    @classmethod
    def default_limits(cls, usage: "UsageContext") -> dict[str, int]:
        """OPTIONAL; once per engine, on the class, before `adjust_config`. This device's
        defaults for "max_num_seqs" and "max_num_batched_tokens" (either or both) when the
        engine is built by `usage` ("LLM_CLASS" or "OPENAI_API_SERVER", vLLM's
        `UsageContext`). The core uses them only for limits the user left unset (then clamps
        them as vLLM does, `polyrunner.default_limits`). Default: {} (`SchedulerConfig`'s
        own, 64 and 2048)."""
        return {}

    # ---- the engine's device (instance) ----------------------------------
    @property
    def device(self) -> torch.device:
        """REQUIRED; at start-up and each step. The torch device the model, the KV
        cache and every step's inputs live on."""
        raise NotImplementedError(f"backend {self.name!r} must define `device`")

    @property
    def default_dtype(self) -> torch.dtype:
        """OPTIONAL; at start-up. The dtype for a model that names none."""
        return torch.float32

    def init_rank(self, local_rank: int, local_size: int) -> None:
        """OPTIONAL; first thing in each tensor-parallel rank (the engine's included),
        before the model loads: take this rank's share of the host (`local_rank` of
        `local_size` ranks here), e.g. its device (default: nothing)."""

    def leave_rank(self) -> None:
        """OPTIONAL; when the engine of rank 0 shuts down (its process, the caller's,
        lives on): undo what `init_rank` changed for the process (default: nothing)."""

    def check_dtype(self, dtype: torch.dtype) -> None:
        """OPTIONAL; at start-up. Raise ValueError naming the allowed dtypes when the
        backend cannot run `dtype` (default: `capabilities.dtypes`)."""
        if dtype not in self.capabilities.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.capabilities.dtypes)
            raise ValueError(f"dtype {dtype} is not supported by backend {self.name!r}; allowed: {names}")

    def quantize_model(self, model: torch.nn.Module, weights: Any) -> int:
        """OPTIONAL; at start-up, when the engine runs a checkpoint format listed in
        `supported_quantization`: the model is built but no weight is loaded yet.
        `weights` is a `QuantizedModel` (polyrunner.models.gguf.quantized): the
        model's "linear" modules with their quantized weights, and the LM head's.
        Swap in modules that compute with them (same call, same result within
        the quantization's error; keep the dense module's `bias` parameter, which
        is loaded afterwards); the dense weights of swapped linears are then not
        loaded, those you leave are. Returns how many it swapped (default: none)."""
        return 0

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        """OPTIONAL. The dtypes this device computes at full speed (not emulated);
        read by `resolve_dtype`. Default: `default_dtype` and float32."""
        return tuple(dict.fromkeys((self.default_dtype, torch.float32)))

    def resolve_dtype(self, model_dtype: torch.dtype | None) -> tuple[torch.dtype, str]:
        """OPTIONAL. The dtype `dtype="auto"` runs, and why (the engine logs it).
        Called once by the engine, before the model is loaded, only for "auto";
        `model_dtype` is the checkpoint's config.json `torch_dtype` (None if it
        names none). Default: the model's dtype where it is in `native_dtypes()`,
        else float32; `default_dtype` for a model that names no dtype."""
        def name(d: torch.dtype) -> str:
            return str(d).removeprefix("torch.")
        if model_dtype is None:
            return self.default_dtype, f"config.json names no torch_dtype: backend {self.name!r}'s default"
        native = self.native_dtypes()
        if model_dtype in native:
            return model_dtype, f"the model's torch_dtype, native on backend {self.name!r}"
        return torch.float32, (f"the model's torch_dtype {name(model_dtype)} is not native on backend "
                               f"{self.name!r} (native: {', '.join(map(name, native))})")

    # ---- padding --------------------------------------------------------
    def bucket_policy(self) -> BucketPolicy:
        """OPTIONAL; once at start-up, after `make_executor` (it may read
        `self.executor`). Token and request buckets for `self.config`; every step
        is padded with `policy.pad(tokens, reqs)`. Buckets are sorted; `pad`
        returns a covering bucket, monotonic in both arguments. The base backend
        pads nothing."""
        return BucketPolicy()

    # ---- KV cache -------------------------------------------------------
    def kv_cache_budget(self, weights_bytes: int, profile: Callable[[], None]) -> int:
        """OPTIONAL; once at start-up. Bytes for the KV cache, given the weights'
        bytes; `profile()` runs a max-size dummy step (call it exactly once, to fail
        early and to measure the peak). `kv_cache_memory_bytes`, when set, wins."""
        config = self.config
        if config.cache.kv_cache_memory_bytes is not None:
            profile()
            return config.cache.kv_cache_memory_bytes
        free, total = self.memory_info()
        profile()
        return max(0, int(free * config.cache.memory_utilization) - weights_bytes)

    def num_kv_blocks(self, spec: KVCacheSpec, budget_bytes: int) -> int:
        """OPTIONAL; once at start-up. Blocks whose allocation (`allocate_kv_cache`)
        fits `budget_bytes` (override with a layout that pads or splits blocks)."""
        return spec.num_blocks_for(budget_bytes, self.kv_alignment_bytes)

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
        """OPTIONAL; at start-up (twice: a 2-block cache for the profile step, then
        the real one). One tensor per layer with the logical shape
        `spec.layer_shape(num_blocks)` and `spec.dtype` on `device`; layers and K/V
        do not alias; the null block (0) holds finite values. The physical layout
        behind the logical view is the backend's (strides, splits, alignment)."""
        return [torch.zeros(spec.layer_shape(num_blocks), dtype=spec.dtype, device=self.device)
                for _ in range(spec.num_layers)]

    def wait_kv_cache_mapped(self, timeout: float | None = None) -> bool:
        """OPTIONAL; for callers that time steps (benchmarks). Block, at most `timeout`
        seconds, until a KV cache that the backend maps in the background
        (`CacheConfig.prefault_kv_cache`) is fully mapped; True when it is (the default:
        nothing is mapped in the background)."""
        return True

    # ---- attention ------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        """OPTIONAL; each layer of each step, also inside graph capture (so no host
        synchronisation, no data-dependent shapes in a captured or compiled
        backend). Write this step's k/v at `meta.slot_mapping` (padded tokens write
        the null block only), then attend causally over each request's context.
        Shapes as in `reference_paged_attention`; the result must match it."""
        return reference_paged_attention(q, k, v, kv_cache, meta, spec)

    def host_attention_extras(self, step: "StepInputs") -> dict[str, np.ndarray]:
        """OPTIONAL; each step, before the upload. Extra host arrays built from the
        padded step (numpy), moved with `to_device` into `meta.extras` under the
        same keys; e.g. per-token block tables, so that a compiled graph depends
        on the token padding only."""
        return {}

    def no_grad(self) -> AbstractContextManager[Any]:
        """OPTIONAL; each step and dummy run. The grad-free context every forward
        runs under (inference_mode by default; a device whose tracer cannot take
        inference tensors returns no_grad)."""
        return torch.inference_mode()

    # ---- op overrides ---------------------------------------------------
    def op_overrides(self, dtype: torch.dtype) -> Mapping[str, Callable[[torch.nn.Module], torch.nn.Module]]:
        """OPTIONAL; once at start-up, after the model is loaded in `dtype` and before
        `make_executor`. Per role of `polyrunner.ops.MODULE_ROLES` ("linear", "rms_norm",
        "rotary", "gated_mlp"), a factory taking the model's module in that role and returning
        the module to use: the same call with the same result within the dtype's tolerance
        (the role table `polyrunner.ops.ROLES`), or its argument, unchanged, to keep it (a
        module it does not accelerate); `{}` for a dtype it does not accelerate. A factory with a
        `prepare(modules)` method first gets all of its role's modules. The core applies them with
        `polyrunner.ops.apply_overrides`; an unknown role is a ValueError. Default: none."""
        return {}

    # ---- graphs ---------------------------------------------------------
    def make_executor(self, model: torch.nn.Module) -> GraphExecutor:
        """OPTIONAL; once at start-up, after the model is loaded and `op_overrides`
        applied. The executor that runs the model; the core keeps it as
        `self.executor` for the members it calls later."""
        return GraphExecutor(model)

    # ---- host <-> device ------------------------------------------------
    def to_device(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        """OPTIONAL; each step, once per input array. The array on `device`; the
        host array may be reused after the call returns (copy or pin as needed)."""
        t = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        return t.to(self.device, non_blocking=True)

    def to_host_async(self, tensor: torch.Tensor) -> HostFuture:
        """OPTIONAL; each step, for the sampled tokens (and each tensor of the step's logprobs and
        prompt logprobs, `LogprobsTensors.to_host_async`). Start the copy to the host;
        `result()` of the returned future waits for it. With asynchronous
        scheduling the core calls `result()` one step later, after it queued the
        next step's work (which reads `tensor` on the device): the copy must not
        wait for that work, and `tensor` must not be overwritten by it."""
        return HostFuture(tensor.to("cpu"))

    def synchronize(self) -> None:
        """OPTIONAL; by graph helpers and checks. Wait for all queued device work."""
        return None

    def make_generator(self, seed: int) -> torch.Generator:
        """OPTIONAL; once per seeded request (and once for the engine's seed). A
        generator on `device` seeded with `seed`; the same seed must give the same
        stream on every run."""
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    @property
    def memory_is_host(self) -> bool:
        """OPTIONAL. The device computes in host memory (its `memory_info` is the
        host's); hygiene checks then measure the process's RSS."""
        return self.device.type == "cpu"

    def memory_info(self) -> tuple[int, int]:
        """REQUIRED unless kv_cache_memory_bytes is always set; at start-up (KV
        budget) and by hygiene checks. (free, total) bytes of the memory the KV
        cache lives in."""
        raise NotImplementedError(f"backend {self.name!r} must report memory_info")
