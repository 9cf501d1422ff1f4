"""CPU executor: threads, the LM head's packed copy, CPU graphs of decode steps.

- The model arrives with the CPU backend's op overrides applied by the core
  (`op_overrides.py`): bfloat16 "linear"s packed for the kernels measured fastest
  here (`packed_linear.py`), fused RMSNorm, rotary and `silu(gate) * up`
  (`fused_modules.py`, bfloat16 and float32). The executor packs the LM head for the logits the same way
  and reads the final modules: which step sizes run whole on the pool, whether a
  decode step is all C++ kernels (then it is graph-captured).
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
  helpers need.
- Graphs (`graphs.py`, the core's `StaticGraphExecutor`: FULL_DECODE_ONLY, keyed
  by the padded batch size, vLLM's capture sizes up to `graph_rows`): a decode
  step whose every op is a C++ kernel (fused modules, pool linears: packed bfloat16
  ones, or a GGUF file's quantized ones in either activation dtype) is recorded once
  and replayed by one C call, without the ~60 us of Python per layer. Off with
  `enforce_eager`, `POLYRUNNER_CPU_GRAPHS=0`, torch's linears (a dense float32 model)
  and tensor parallelism (an all-reduce between the kernels); prefill and mixed
  steps run eagerly.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from torch import nn

from polyrunner.backends.cpu import decode_prefetch, envs, kernel_table, kernels, linear_prefetch, threads
from polyrunner.backends.cpu.fused_modules import FusedMLP, FusedRMSNorm, FusedRotary
from polyrunner.backends.cpu.graphs import CPUGraphAPI
from polyrunner.backends.cpu.host_memory import keep_freed_memory
from polyrunner.backends.cpu.packed_linear import PackedLinear, pack_lm_head, packing_supported
from polyrunner.backends.cpu.quant_linear import QuantLinear, quantized_lm_head
from polyrunner.backends.cpu.quant_runs import QuantRunsLinear
from polyrunner.plugin_api import (
    BucketPolicy,
    GraphAPI,
    GraphBucketPolicy,
    LayerSpec,
    ModelInputs,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    StaticGraphExecutor,
)

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


# ---- the model's linears ----------------------------------------------------------
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
    if isinstance(module, (QuantLinear, QuantRunsLinear)):
        return module.dense_above
    return 0


def pool_step_rows(model: nn.Module) -> int:
    """The largest step (tokens) whose every linear of the model's forward runs on
    the pool's small-M kernels; 0 when some linear never does (then torch/oneDNN's
    OpenMP team computes it and keeps its threads)."""
    linears = [getattr(parent, name) for parent, name, _ in replaceable(model, "linear")]
    return min(pool_rows(m) for m in linears) if linears else 0


# ---- executor -------------------------------------------------------------------
class CPUExecutor(StaticGraphExecutor):
    """Threads, the packed LM head, and CPU graphs (`graphs.py`) of the
    decode steps the pool's kernels run whole: `graph_rows` is the largest
    captured batch (0: none, every step eager)."""

    def __init__(self, model: nn.Module, config) -> None:
        lib = kernels.paged_attention_kernel()
        super().__init__(model, CPUGraphAPI(lib) if lib is not None else GraphAPI(),
                         max_num_seqs=config.scheduler.max_num_seqs, enforce_eager=config.runner.enforce_eager,
                         length_adaptive=True,   # the decode attention's cost follows seq_lens
                         num_warmups=0)          # a capture only records; nothing to warm up first
        keep_freed_memory()   # no page faults on the steps' temporaries (see host_memory.py)
        # one thread per physical core (see threads.py), on OpenMP and the decode kernels' pool
        self.threads = threads.start_pool()
        self.governor = ThreadGovernor(self.threads) if threads.threads_auto() else None
        self.spin_us = threads.spin_us()
        self._spinning = True
        self._sampler = Sampler(argmax=kernels.argmax_f32)
        small = envs.SMALL_STEP_THREADS.get()
        self.small_threads = max(1, min(self.threads, small)) if small is not None else None
        self._current_threads = None
        self.block_size = config.cache.block_size
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        self.packed_logits: nn.Module | None = quantized_lm_head(model)  # GGUF blocks, when quantized
        if packing_supported(dtype):
            lm_head_weight = getattr(model, "lm_head_weight", None)   # optional model hook
            weight = None if lm_head_weight is None else lm_head_weight()
            if weight is not None and weight.dtype == torch.bfloat16 and self.packed_logits is None:
                self.packed_logits = pack_lm_head(weight, config.scheduler.max_num_seqs, self.threads)
        # what packing the LM head and the linears (the "linear" op override) measured or read
        self.kernel_tables = list(dict.fromkeys(
            m.report for m in (self.packed_logits, *model.modules()) if isinstance(m, PackedLinear) and m.report))
        if self.kernel_tables:   # and the prefetch level they were timed and run at (read back: `planned` chose it)
            self.kernel_tables.append(linear_prefetch.choose(self.threads))
        fused = any(isinstance(m, (FusedRMSNorm, FusedMLP, FusedRotary)) for m in model.modules())
        forward_rows = min(pool_step_rows(model), POOL_STEP_ROWS)
        self.pool_rows = min(forward_rows, pool_rows(self.packed_logits))   # with the LM head (rows = requests)
        # graphs need every op of a decode step in a C++ kernel: fused modules, pool linears,
        # no all-reduce between them (tensor parallelism)
        graphs = (lib is not None and fused and not config.runner.enforce_eager
                  and config.parallel.tensor_parallel_size == 1
                  and envs.GRAPHS.get())
        self.graph_rows = min(forward_rows, config.scheduler.max_num_seqs) if graphs else 0   # the forward only

    def prepare(self, run_dummy, buckets: BucketPolicy) -> None:
        """Choose where the decode attention prefetches (`decode_prefetch.py`; before any capture, as
        its timing calls the kernel), then capture a graph per token bucket up to `graph_rows` (none
        when 0), whatever the backend's (or a subclass's) policy pads to: a step of another size runs
        eagerly."""
        spec = next((m.spec for m in self.model.modules() if isinstance(getattr(m, "spec", None), LayerSpec)), None)
        if spec is not None and kernels.paged_attention_kernel() is not None:
            self.kernel_tables.append(decode_prefetch.choose(spec, self.block_size, self.threads))
        sizes = [b for b in buckets.token_buckets if b <= self.graph_rows]
        if sizes:
            super().prepare(run_dummy, GraphBucketPolicy(sizes, sizes))

    def kernel_report(self) -> str | None:
        """The bfloat16 linears' kernel per weight shape and row count, with the times behind it, and where
        they and the decode attention prefetch."""
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
