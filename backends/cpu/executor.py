"""CPU executor: packed weights, fused elementwise ops, threads, CPU graphs of decode steps.

- Which modules are swapped: the model names them, by role, through its
  `replaceable_modules()` hook (the model protocol in `polyrunner_models`):
  "linear", "rms_norm", "gated_mlp", "rotary". A model without it runs as is.
- Weights: every bfloat16 "linear" (and the LM head, for the logits) is packed for
  the kernels measured fastest on this machine at its shape, per row count
  (`kernel_table.py`: AMX tiles `linear_amx.cpp`, AVX512_BF16 dot products
  `linear_bf16.cpp`, oneDNN's packed matmul; timed at the first start, then cached).
  Steps of at most `POOL_STEP_ROWS` rows choose among the pool's kernels (AMX,
  AVX512_BF16) where the CPU has one, so they stay graph-replayable; CPUs with
  neither keep oneDNN. `POLYRUNNER_CPU_LINEAR` forces one kernel.
- bfloat16 RMSNorm (also fused with the residual add before it), rotary
  embedding (in place) and `silu(gate) * up` run as single C++ passes
  (`paged_attention.cpp`) with Hugging Face's exact roundings.
- Threads (`threads.py`): `POLYRUNNER_CPU_THREADS`, default "auto": one per
  physical core. torch/oneDNN ops (prefill) run on OpenMP with that many threads,
  less those other processes kept busy (`ThreadGovernor`, from /proc/stat every
  half second); `POLYRUNNER_CPU_SMALL_STEP_THREADS` pins steps of at most 16
  tokens to a fixed count. An OpenMP region waits for its slowest thread, so on a
  shared host a thread whose core another process holds stalls it for a time
  slice; the decode kernels (small-M linears, decode attention, greedy argmax)
  therefore run on a work-sharing pool (`thread_pool.cpp`) that never waits for a
  thread that has not started; it takes part with the same count as OpenMP.
  A step small enough that every linear runs on the pool (`pool_step_rows`)
  gives torch one thread: a torch op there (the logits' `.float()`, say) would
  otherwise wake OpenMP's team, whose workers then spin on the cores the pool's
  helpers need (measured: single-stream bfloat16 decode 13.9 -> 8.7 ms/token on 2
  Zen 4 cores).
- Graphs (`graphs.py`, the core's `StaticGraphExecutor`: FULL_DECODE_ONLY, keyed
  by the padded batch size, vLLM's capture sizes up to `graph_rows`): a decode
  step whose every op is a C++ kernel (fused bfloat16 modules, pool linears) is
  recorded once and replayed by one C call, without the ~60 us of Python per
  layer (measured on 2 Zen 4 cores: quantized SmolLM2 single stream 6.0 -> 3.8
  ms/token). Off with `enforce_eager`, `POLYRUNNER_CPU_GRAPHS=0`, float32 and
  tensor parallelism (an all-reduce between the kernels); prefill and mixed
  steps run eagerly.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from polyrunner.backends.cpu import envs, kernel_table, kernels, threads
from polyrunner.backends.cpu.graphs import CPUGraphAPI
from polyrunner.backends.cpu.host_memory import keep_freed_memory
from polyrunner.backends.cpu.quant_linear import QuantLinear, quantized_lm_head
from polyrunner.plugin_api import (
    BucketPolicy,
    GraphAPI,
    GraphBucketPolicy,
    ModelInputs,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    StaticGraphExecutor,
    graph_token_sizes,
)

logger = logging.getLogger(__name__)

SMALL_STEP_TOKENS = 16
# Steps of at most this many tokens may run whole on the pool's kernels (torch then gets one thread)
# and be captured as CPU graphs; larger ones keep OpenMP's team for the fused ops and attention.
POOL_STEP_ROWS = kernel_table.POOL_STEP_ROWS


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ThreadGovernor:
    """How many threads a large step should use: the usable CPUs minus those
    other processes kept busy over the last interval (Linux /proc/stat).

    Only intervals the engine spent stepping count: after a gap of more than
    `stale_after` seconds between calls (the engine sat idle) the count starts
    again from every thread. What others did while we were idle says little
    about now: a benchmark client's start-up, or clients that wait on our tokens.
    (Measured: the first requests of a serving run prefilled on one thread, and
    at rate 4 they were its slowest, at 296-298 ms to the first token.)"""

    def __init__(self, max_threads: int, interval: float = 0.5, stale_after: float = 2.0,
                 sample: Callable[[], tuple[float, float, float] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max_threads
        self.interval = interval
        self.stale_after = stale_after
        self.current = max_threads
        self._sample = sample or threads.cpu_sample
        self._clock = clock
        self._last = self._sample()

    def threads(self) -> int:
        if self.max_threads == 1 or self._last is None:
            return self.max_threads
        if self._clock() - self._last[0] < self.interval:
            return self.current
        sample = self._sample()
        if sample is None:
            return self.current
        wall = sample[0] - self._last[0]
        if wall > self.stale_after:   # idle since the last call: start again from every thread
            self._last, self.current = sample, self.max_threads
            return self.current
        others = threads.busy_elsewhere(self._last, sample)
        self._last = sample
        free = available_cpus() - others
        self.current = max(1, min(self.max_threads, int(free + 0.3)))
        return self.current


# ---- packed weights -------------------------------------------------------------
class PackedLinear(nn.Module):
    """A bfloat16 linear layer packed for the kernels `plan` names, one per row count (chosen by
    measurement, `kernel_table.py`): a step of M rows runs `plan[min(M, len(plan) - 1)]`, and only
    the kernels the plan names keep a packed copy. With a bias: oneDNN only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int,
                 plan: tuple[str, ...] = ("onednn",)) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.plan = plan if bias is None else ("onednn",)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        for kernel in dict.fromkeys(self.plan):
            self.register_buffer(f"packed_{kernel}", kernel_table.pack(kernel, weight, batch_hint), persistent=False)
        self._by_rows = [(kernel_table.runner(k), getattr(self, f"packed_{k}")) for k in self.plan]
        self.pool_rows = kernel_table.pool_prefix(self.plan)   # steps up to this many rows run on the pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            shape = x.shape
            return self.forward(x.reshape(-1, shape[-1])).reshape(*shape[:-1], self.out_features)
        if x.stride(1) != 1:
            x = x.contiguous()
        fn, packed = self._by_rows[min(x.shape[0], len(self._by_rows) - 1)]
        return fn(x, packed, self.out_features, self.bias)


def packing_supported(dtype: torch.dtype) -> bool:
    if dtype != torch.bfloat16 or not envs.PACK.get():
        return False
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def replaceable(model: nn.Module, role: str) -> list[tuple[nn.Module, str, nn.Module]]:
    """`(parent, attribute, module)` of the model's parts in `role`, from its optional
    `replaceable_modules()` hook (see `polyrunner_models`); none without the hook."""
    hook = getattr(model, "replaceable_modules", None)
    if hook is None:
        return []
    return [(parent, name, module) for r, parent, name, module in hook() if r == role]


def pool_rows(module: nn.Module) -> int:
    """The most rows `module` (a linear) runs on the pool's kernels; 0 for one that never does."""
    if isinstance(module, PackedLinear):
        return module.pool_rows
    if isinstance(module, QuantLinear):
        return module.dense_above
    return 0


def pool_step_rows(model: nn.Module) -> int:
    """The largest step (tokens) whose every linear of the model's forward runs on
    the pool's small-M kernels; 0 when some linear never does (then torch/oneDNN's
    OpenMP team computes it and keeps its threads)."""
    linears = [getattr(parent, name) for parent, name, _ in replaceable(model, "linear")]
    return min(pool_rows(m) for m in linears) if linears else 0


def pack_linears(model: nn.Module, batch_hint: int, threads: int = 1, align: Sequence[int] = ()) -> int:
    """Replace every bfloat16 "linear" the model declares (an `nn.Linear`) by a PackedLinear running
    the kernels measured fastest here per row count up to `batch_hint` (the step's token budget;
    `kernel_table.py`, timed on `threads` threads; `align`: the graphs' batch sizes, see
    `kernel_table.plan`); returns how many."""
    targets = [(parent, name, child) for parent, name, child in replaceable(model, "linear")
               if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16]
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    for _, _, child in targets:
        if child.bias is None:
            by_shape.setdefault(tuple(child.weight.shape), []).append(child.weight.detach())
    plans = kernel_table.plans(by_shape, batch_hint, threads, batch_hint, align)
    for parent, name, child in targets:
        plan = plans.get(tuple(child.weight.shape), ("onednn",))
        setattr(parent, name, PackedLinear(child.weight, child.bias, batch_hint, plan))
    return len(targets)


def pack_lm_head(weight: torch.Tensor, max_rows: int, threads: int = 1) -> PackedLinear:
    """The LM head's packed copy for the logits (steps of at most `max_rows` requests)."""
    shape = tuple(weight.shape)
    plan = kernel_table.plans({shape: [weight.detach()]}, max_rows, threads, max_rows)[shape]
    return PackedLinear(weight, None, max_rows, plan)


# ---- fused elementwise modules ---------------------------------------------------
class FusedRMSNorm(nn.Module):
    """Hugging Face RMSNorm (normalise in float32, scale in bfloat16) as one C++ pass."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.eps)
        self.inner = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.weight.shape[0]:
            return self.inner(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return kernels.rms_norm_bf16(x2, self.weight, self.eps).view(shape)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)` in one C++ pass."""
        if (x.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16 or x.shape != residual.shape
                or x.shape[-1] != self.weight.shape[0]):
            residual = x + residual
            return self(residual), residual
        shape = x.shape
        out, r = kernels.add_rms_norm_bf16(x.reshape(-1, shape[-1]).contiguous(),
                                           residual.reshape(-1, shape[-1]).contiguous(), self.weight, self.eps)
        return out.view(shape), r.view(shape)


class FusedMLP(nn.Module):
    """gate_up -> silu(gate) * up (one C++ pass) -> down."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj
        self.intermediate = mlp.intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        shape = gu.shape
        if gu.dtype != torch.bfloat16:
            gate, up = gu.split(self.intermediate, dim=-1)
            return self.down_proj(torch.nn.functional.silu(gate) * up)
        h = kernels.silu_mul_bf16(gu.reshape(-1, shape[-1]))
        return self.down_proj(h.view(*shape[:-1], self.intermediate))


class FusedRotary(nn.Module):
    """Rotary embedding applied in place by one C++ pass (bfloat16, HF roundings)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.inner = rotary

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.inner.cos, self.inner.sin
        D = q.shape[-1]
        if (q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or D % 2 or D > 512
                or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous())
                or q.stride(-1) != 1 or q.stride(-2) != D or k.stride(-1) != 1 or k.stride(-2) != D):
            return self.inner(positions, q, k)
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        kernels.rotary_bf16_(positions, q, k, cos, sin)
        return q, k


def fuse_elementwise(model: nn.Module) -> int:
    """Swap the model's "rms_norm" (bfloat16 weight), "gated_mlp" and "rotary"
    modules for the fused C++ ones; returns how many. bfloat16 only."""
    if kernels.paged_attention_kernel() is None:
        return 0
    swaps = [(parent, name, FusedRMSNorm(norm)) for parent, name, norm in replaceable(model, "rms_norm")
             if norm.weight.dtype == torch.bfloat16]
    swaps += [(parent, name, FusedMLP(mlp)) for parent, name, mlp in replaceable(model, "gated_mlp")]
    rotaries: dict[int, FusedRotary] = {}  # one shared module stays one
    swaps += [(parent, name, rotaries.setdefault(id(rotary), FusedRotary(rotary)))
              for parent, name, rotary in replaceable(model, "rotary")]
    for parent, name, new in swaps:
        setattr(parent, name, new)
    return len(swaps)


# ---- executor -------------------------------------------------------------------
class CPUExecutor(StaticGraphExecutor):
    """Packed and fused modules, threads, and CPU graphs (`graphs.py`) of the
    decode steps the pool's kernels run whole: `graph_rows` is the largest
    captured batch (0: none, every step eager)."""

    def __init__(self, model: nn.Module, config) -> None:
        lib = kernels.paged_attention_kernel()
        super().__init__(model, CPUGraphAPI(lib) if lib is not None else GraphAPI(),
                         max_num_seqs=config.scheduler.max_num_seqs, enforce_eager=config.runner.enforce_eager,
                         length_adaptive=True,   # the decode attention's cost follows seq_lens
                         num_warmups=0)          # a capture only records; nothing to warm up first
        keep_freed_memory()   # no page faults on the steps' temporaries (see host_memory.py)
        self.threads = threads.default_threads()  # one per physical core (see threads.py)
        auto = threads.threads_auto()
        self.governor = ThreadGovernor(self.threads) if auto else None
        # the decode kernels' work-sharing pool: helpers on one CPU per physical core
        self.spin_us = threads.spin_us()
        kernels.start_pool(self.threads, threads.physical_cpus() if auto else None, self.spin_us)
        self._spinning = True
        self._sampler = Sampler(argmax=kernels.argmax_f32)
        small = envs.SMALL_STEP_THREADS.get()
        self.small_threads = max(1, min(self.threads, small)) if small is not None else None
        self._current_threads = None
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        reports = len(kernel_table.reports)
        self.packed_logits: nn.Module | None = quantized_lm_head(model)  # GGUF blocks, when quantized
        if packing_supported(dtype):
            hint = max(64, min(config.scheduler.max_num_batched_tokens, 2048))
            lm_head_weight = getattr(model, "lm_head_weight", None)   # optional model hook
            weight = None if lm_head_weight is None else lm_head_weight()
            if weight is not None and weight.dtype == torch.bfloat16 and self.packed_logits is None:
                self.packed_logits = pack_lm_head(weight, config.scheduler.max_num_seqs, self.threads)
            n = pack_linears(model, hint, self.threads, graph_token_sizes(config))
            logger.debug("packed %d linear layers", n)
        self.kernel_tables = kernel_table.reports[reports:]   # what packing measured or read for this model
        fused = 0
        if dtype == torch.bfloat16 and envs.FUSE.get():
            fused = fuse_elementwise(model)
        forward_rows = min(pool_step_rows(model), POOL_STEP_ROWS)
        self.pool_rows = min(forward_rows, pool_rows(self.packed_logits))   # with the LM head (rows = requests)
        # graphs need every op of a decode step in a C++ kernel: fused bfloat16 modules, pool linears,
        # no all-reduce between them (tensor parallelism)
        graphs = (lib is not None and fused > 0 and not config.runner.enforce_eager
                  and config.parallel.tensor_parallel_size == 1
                  and envs.GRAPHS.get())
        self.graph_rows = min(forward_rows, config.scheduler.max_num_seqs) if graphs else 0   # the forward only

    def prepare(self, run_dummy, buckets: BucketPolicy) -> None:
        """Capture a graph per token bucket up to `graph_rows` (none when 0), whatever
        the backend's (or a subclass's) policy pads to: a step of another size runs eagerly."""
        sizes = [b for b in buckets.token_buckets if b <= self.graph_rows]
        if sizes:
            super().prepare(run_dummy, GraphBucketPolicy(sizes, sizes))

    def kernel_report(self) -> str | None:
        """The bfloat16 linears' kernel per weight shape and row count, with the times behind it."""
        return "\n".join(self.kernel_tables) or None

    # ---- threads ---------------------------------------------------------------
    def _set_threads(self, num_tokens: int) -> None:
        if num_tokens <= SMALL_STEP_TOKENS and self.small_threads is not None:
            n = self.small_threads
        else:
            n = self.governor.threads() if self.governor is not None else self.threads
        # steps the pool computes whole: torch gets one thread (OpenMP's team stays asleep)
        pool_step = num_tokens <= self.pool_rows
        if (n, pool_step) != self._current_threads:
            torch.set_num_threads(1 if pool_step else n)
            kernels.set_pool_threads(n)
            self._current_threads = n, pool_step
        # helpers spin between the small calls of decode-sized steps; in larger steps
        # oneDNN's OpenMP team needs every core, and a spinning helper would hold one
        spin = num_tokens <= POOL_STEP_ROWS
        if spin != self._spinning:
            kernels.set_pool_spin(self.spin_us if spin else 0)
            self._spinning = spin

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        self._set_threads(inputs.input_ids.shape[0])
        return super().run(inputs)

    # ---- sampling -----------------------------------------------------------------
    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """The core sampler, with greedy rows' argmax in C++ (`argmax.cpp`)."""
        return self._sampler(logits[:meta.num_reqs], meta)

    # ---- logits -------------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor, inputs: ModelInputs, num_reqs: int) -> torch.Tensor:
        """The LM head through its packed copy when there is one."""
        if self.packed_logits is None:
            return super().compute_logits(hidden, inputs, num_reqs)
        return self.packed_logits(self.logit_rows(hidden, inputs, num_reqs)).float()
