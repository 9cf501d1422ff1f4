"""The backend contract: what a device plugin supplies to the core.

A backend is a `Backend` subclass contributed through the
`polyrunner_backends` hook. The base class implements every method for a plain
torch device (eager execution, no padding, reference attention, blocking
transfers), so a plugin overrides only what its device does differently:

- identity: `name`, `priority`, `probe()`, `device`, `default_dtype`, `capabilities`;
- dtype="auto": `native_dtypes()`, `resolve_dtype(model_dtype)`;
- padding: `bucket_policy(config)`;
- KV cache: `kv_cache_budget(...)`, `kv_alignment_bytes`, `allocate_kv_cache(spec, n)`;
- attention: `attention(q, k, v, kv_cache, meta, spec)` over `AttentionMetadata`;
- graphs: `make_executor(model, config)` returning a `GraphExecutor`;
- host<->device: `to_device`, `to_host_async`, `synchronize`, `make_generator`,
  `memory_info`; tensor parallelism: `communicator_backend`.

Probing must never raise and must not import the device library at module
import time: a missing library is `Availability(False, "<reason>")`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np
import torch

from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import reference_paged_attention
from polyrunner.device.buckets import BucketPolicy
from polyrunner.device.kv_spec import KVCacheSpec
from polyrunner.sample import Sampler, SamplerOutput, SamplingMetadata

if TYPE_CHECKING:
    from polyrunner.config import EngineConfig
    from polyrunner.runner.inputs import StepInputs

_SAMPLER = Sampler()

# Sampling features a backend may or may not run on its device.
SAMPLING_FEATURES = frozenset({
    "temperature", "top_k", "top_p", "min_p", "penalties", "logit_bias",
    "allowed_token_ids", "bad_words", "seed", "logprobs", "prompt_logprobs",
})


@dataclass(frozen=True)
class Availability:
    """Result of a probe: usable or not, why not, and which device."""

    available: bool
    reason: str = ""
    device: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares about itself.

    graph_mode: "eager", "torch_compile", "cuda_graph", "xla", "acl_graph".
    static_shapes: every step must be padded to a bucket (tokens and requests).
    counts_graphs: `GraphExecutor.num_graphs()` is meaningful (no-recompile checks).
    sampling: sampling features supported on the device; requests that need
      another one are rejected with a clear error.
    """

    graph_mode: str = "eager"
    static_shapes: bool = False
    counts_graphs: bool = False
    async_output: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    sampling: frozenset[str] = SAMPLING_FEATURES


@dataclass
class ModelInputs:
    """One padded step, on the device: what the model forward consumes."""

    input_ids: torch.Tensor        # [T_pad] int64
    positions: torch.Tensor        # [T_pad] int64
    attn: AttentionMetadata
    kv_caches: list[torch.Tensor]  # one per layer
    logits_indices: torch.Tensor   # [R_pad] int64: rows of the hidden states to sample


class GraphExecutor:
    """Runs the model on padded batches; the base class runs eagerly.

    `prepare(run_dummy)` is called once after KV allocation: capture, compile or
    warm up every bucket by calling `run_dummy(num_tokens, num_reqs)`, which
    builds a dummy `ModelInputs` and calls `self.run` on it.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def prepare(self, run_dummy: Callable[[int, int], Any], buckets: BucketPolicy) -> None:
        return None

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Final hidden states `[T_pad, hidden]` of the padded batch."""
        return self.model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches)

    def num_graphs(self) -> int | None:
        """Graphs compiled or captured so far; None when the backend does not count."""
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
        return self.model.compute_logits(self.logit_rows(hidden, inputs, num_reqs))

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
    """Base backend: a plain torch device, eager, unpadded. Override per device."""

    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0
    capabilities: ClassVar[Capabilities] = Capabilities()
    kv_alignment_bytes: ClassVar[int] = 1
    communicator_backend: ClassVar[str] = "gloo"

    # ---- identity -------------------------------------------------------
    @classmethod
    def probe(cls) -> Availability:
        """Is the device usable here? Never raises."""
        return Availability(False, "abstract base backend")

    @property
    def device(self) -> torch.device:
        raise NotImplementedError(f"backend {self.name!r} must define `device`")

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self.capabilities.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.capabilities.dtypes)
            raise ValueError(f"dtype {dtype} is not supported by backend {self.name!r}; allowed: {names}")

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
    def bucket_policy(self, config: "EngineConfig") -> BucketPolicy:
        """Token and request buckets; the base backend pads nothing."""
        return BucketPolicy()

    # ---- KV cache -------------------------------------------------------
    def kv_cache_budget(self, config: "EngineConfig", weights_bytes: int,
                        profile: Callable[[], None]) -> int:
        """Bytes for the KV cache. `profile()` runs a max-size dummy step."""
        if config.cache.kv_cache_memory_bytes is not None:
            profile()
            return config.cache.kv_cache_memory_bytes
        free, total = self.memory_info()
        profile()
        return max(0, int(free * config.cache.memory_utilization) - weights_bytes)

    def num_kv_blocks(self, spec: KVCacheSpec, budget_bytes: int) -> int:
        """Blocks whose allocation (`allocate_kv_cache`) fits `budget_bytes`."""
        return spec.num_blocks_for(budget_bytes, self.kv_alignment_bytes)

    def allocate_kv_cache(self, spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
        """One zeroed tensor per layer with logical shape `spec.layer_shape(num_blocks)`."""
        return [torch.zeros(spec.layer_shape(num_blocks), dtype=spec.dtype, device=self.device)
                for _ in range(spec.num_layers)]

    # ---- attention ------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, spec: LayerSpec) -> torch.Tensor:
        """Write this step's k/v into the cache, then attend. Shapes as in
        `reference_paged_attention`."""
        return reference_paged_attention(q, k, v, kv_cache, meta, spec)

    def build_attention_extras(self, meta: AttentionMetadata) -> None:
        """Add backend-specific tensors to `meta.extras` (called once per step)."""
        return None

    def host_attention_extras(self, step: "StepInputs") -> dict[str, np.ndarray]:
        """Extra host arrays built from the padded step (numpy), moved with
        `to_device` into `meta.extras` under the same keys before
        `build_attention_extras`; e.g. per-token block tables, so that a compiled
        graph depends on the token padding only."""
        return {}

    def no_grad(self):
        """The grad-free context every forward runs under (inference_mode by
        default; a device whose tracer cannot take inference tensors returns no_grad)."""
        return torch.inference_mode()

    # ---- graphs ---------------------------------------------------------
    def make_executor(self, model: torch.nn.Module, config: "EngineConfig") -> GraphExecutor:
        return GraphExecutor(model)

    # ---- host <-> device ------------------------------------------------
    def to_device(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        t = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        return t.to(self.device, non_blocking=True)

    def to_host_async(self, tensor: torch.Tensor) -> HostFuture:
        return HostFuture(tensor.to("cpu"))

    def synchronize(self) -> None:
        return None

    def make_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    @property
    def memory_is_host(self) -> bool:
        """The device computes in host memory (its `memory_info` is the host's)."""
        return self.device.type == "cpu"

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the KV cache lives in."""
        raise NotImplementedError(f"backend {self.name!r} must report memory_info")
