"""XLA graph executor: precompile every bucket, then serve without compiling.

torch_xla traces lazily; each `torch_xla.sync()` turns the pending ops into one
graph, compiled the first time its (ops, shapes, dtypes) hash is seen and
replayed afterwards. A step is cut into separately compiled pieces, exactly as
in the TPU reference runner:

  backbone          one graph per token bucket T (the attention reads only
                    T-shaped inputs, see `XLABackend.host_attention_extras`)
                    and, for the static-shape attention, context bucket C
                    (`context_widths`, forced through `set_context` while warming up),
                    compiled once: `torch.compile(backend="openxla", fullgraph=True,
                    dynamic=False)` as vLLM's TPU runner does, so dynamo traces each
                    bucket once during warm-up and serving replays it without
                    re-tracing the model in Python (guards other than the ones that
                    tell buckets apart are skipped once warm); with
                    `POLYRUNNER_XLA_DYNAMO=0` or enforce_eager the model is traced
                    lazily every step (about 4x the host time per decode step)
  select_hidden     hidden[logits_indices], per (T, R) with R <= the first
                    request bucket >= min(T, largest request bucket)
  logits            per request bucket R
  sample_greedy     per R (all rows greedy: mask + argmax)
  sample_random     per R (temperature, top-k/p, min-p, counter-based noise)
  logprobs          per R (raw log_softmax + fixed top-K)

`prepare` compiles all of them (tqdm bar, total time logged). After it,
every compilation is a bug: it is logged, and raises `RecompilationError`
with the offending piece and shapes in strict mode
(`RunnerConfig.strict_no_recompile` or `POLYRUNNER_XLA_STRICT=1`).
Graphs are counted with torch_xla's `CompileTime` metric around this
executor's own syncs, so several engines in one process do not blur the count;
`traces` counts the ops of each graph dynamo traces.

No host sync may run inside the backbone: the lazy trace runs inside the core's
`capture_guard` at every step (a dispatch mode changes how composite ops reach
torch_xla, so warm-up and serving must trace alike; it costs host time, and the
lazy trace is the fallback to dynamo), and under dynamo fullgraph refuses it,
reported as the guard's `HostSyncError` (`host_sync.py`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from polyrunner.backends.xla import compile_cache, envs, host_sync
from polyrunner.backends.xla.sampling import (
    MAX_LOGPROBS,
    STOP_WIDTH,
    RowLogprobs,
    SamplingInputs,
    build_sampling_inputs,
    sample_greedy,
    sample_random,
    topk_logprobs,
)
from polyrunner.plugin_api import (
    BucketPolicy,
    GraphExecutor,
    ModelInputs,
    SamplerOutput,
    SamplingMetadata,
    capture_guard,
)

logger = logging.getLogger(__name__)


class RecompilationError(RuntimeError):
    """A new XLA graph was compiled after warm-up while strict mode is on."""


def strict_from_env() -> bool:
    return envs.STRICT.get()


def select_buckets(num_tokens: int, request_buckets: list[int]) -> list[int]:
    """Request buckets a batch padded to `num_tokens` can have (R <= T)."""
    out = []
    for r in request_buckets:
        out.append(r)
        if r >= min(num_tokens, request_buckets[-1]):
            break
    return out


class XLAGraphExecutor(GraphExecutor):
    def __init__(self, model: torch.nn.Module, device: torch.device, *, strict: bool,
                 enforce_eager: bool, seed: int, context_widths: list[int] | None = None,
                 set_context: Callable[[int | None], None] | None = None) -> None:
        import torch_xla
        import torch_xla.debug.metrics as met
        super().__init__(model)
        self._torch_xla, self._met = torch_xla, met
        self.device = device
        self.strict = strict and not enforce_eager
        self.enforce_eager = enforce_eager
        self.context_widths: list[int | None] = list(context_widths or []) or [None]
        self._set_context = set_context or (lambda width: None)
        self.max_logprobs = MAX_LOGPROBS  # K of the logprob graph (capped at the vocabulary)
        self.rng = np.random.default_rng(seed)
        self.compiled = 0            # graphs compiled by this executor's syncs
        self.warm = False            # True once every bucket is compiled
        self.warmup_pieces = 0       # (piece, shape) pairs precompiled
        self.warmup_graphs = 0       # graphs those compiled (0 for shapes another engine compiled)
        self.warmup_seconds = 0.0
        self.serving_graphs = 0      # graphs compiled after warm-up (should stay 0)
        # disk-cache lookups from here to the end of warm-up (`compile_cache.lookups`): a start
        # whose graphs are all on disk has misses 0 (on a TPU, hits = its graphs)
        # Summed per piece: torch_xla's dynamo bridge clears all counters while it compiles.
        self.warmup_cache: dict[str, int] = dict.fromkeys(compile_cache.COUNTERS, 0)
        if enforce_eager and strict:
            logger.warning("xla: strict_no_recompile is ignored with enforce_eager")
        self.mode = "dynamo" if envs.DYNAMO.get() and not enforce_eager else "trace"
        # per graph dynamo traced (one per backbone bucket; any after warm-up is a recompilation):
        # how many times it calls each op, e.g. {"xla.ragged_paged_attention.default": 32, ...}
        self.traces: list[Counter[str]] = []
        self._forward = self._compile(model) if self.mode == "dynamo" else model
        self._threads = torch.get_num_threads()
        self._settle("load_weights")

    def _compile(self, model: torch.nn.Module) -> Callable[..., torch.Tensor]:
        import torch._dynamo
        from torch._dynamo.backends.registry import lookup_backend
        # one dynamo entry per (token, context) bucket: never fall back to eager for running out
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        openxla = lookup_backend("openxla")

        def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
            self.traces.append(Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
            return openxla(gm, example_inputs)

        return torch.compile(model, backend=backend, fullgraph=True, dynamic=False)

    def _settle(self, piece: str) -> None:
        """Materialise every weight and buffer. Weights loaded through views (fused
        projections, `to_empty`) stay lazy `as_strided` views of their storage until
        functionalization syncs them; left lazy, they would ride along in the first
        compiled graph only, and its twin would compile again when serving."""
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if torch._is_functional_tensor(t):
                torch._functionalize_sync(t)
        self._sync(piece, ())

    # ---- graph accounting --------------------------------------------------------
    def _compile_count(self) -> int:
        data = self._met.metric_data("CompileTime")
        return 0 if data is None else int(data[0])

    def _sync(self, piece: str, shape: Any, before: int | None = None,
              lookups: dict[str, int] | None = None) -> None:
        """Sync and account the graphs compiled, and the disk-cache lookups made, since `before` /
        `lookups` (default: now). A counter found lower than before was cleared (dynamo's
        bridge does so): what it counts now is what happened since."""
        before = self._compile_count() if before is None else before
        lookups = compile_cache.lookups() if lookups is None else lookups
        self._torch_xla.sync()
        if not self.warm:
            now = compile_cache.lookups()
            for k, v in now.items():
                self.warmup_cache[k] += v - lookups[k] if v >= lookups[k] else v
        new = self._compile_count() - before
        if not new:
            return
        self.compiled += new
        if self.warm:
            self.serving_graphs += new
            msg = (f"{new} new XLA graph(s) compiled after warm-up for piece {piece!r} at shape "
                   f"{shape}; every bucket should have been precompiled")
            if self.strict:
                raise RecompilationError(msg)
            logger.warning(msg)

    def num_graphs(self) -> int:
        return self.compiled

    def _dev(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        t = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        return t.to(self.device)

    # ---- warm-up ------------------------------------------------------------------
    def prepare(self, run_dummy: Callable[[int, int], Any], buckets: BucketPolicy) -> None:
        if self.enforce_eager:
            logger.warning("xla: enforce_eager is set, skipping precompilation; every new shape "
                           "compiles when first seen (slow first steps)")
            return
        tokens, reqs = buckets.token_buckets, buckets.request_buckets
        widths = self.context_widths
        plan = len(tokens) * len(widths) + sum(len(select_buckets(t, reqs)) for t in tokens) + 4 * len(reqs)
        self.warmup_pieces = plan
        t0 = time.perf_counter()
        self._settle("settle")
        start_graphs = self.compiled
        bar = tqdm(total=plan, desc="XLA precompile", unit="graph", leave=False)
        hidden = None
        with no_grad_not_inference():
            for T in tokens:
                for C in widths:
                    bar.set_postfix_str(f"backbone T={T}" + (f" C={C}" if C else ""))
                    self._set_context(C)
                    hidden = run_dummy(T, min(T, reqs[-1]))
                    bar.update()
                self._set_context(None)
                for R in select_buckets(T, reqs):
                    self._select(hidden, self._dev(np.zeros(R, np.int64)))
                    bar.update()
            for R in reqs:
                bar.set_postfix_str(f"sampling R={R}")
                sel = self._dev(torch.zeros(R, hidden.shape[1], dtype=hidden.dtype))
                logits = self._logits(sel)
                dummy = _dummy_sampling(R, logits.shape[1])
                self._sample(logits, dummy, all_greedy=True)
                sampled = self._sample(logits, dummy, all_greedy=False)
                self._logprobs(logits, sampled)
                bar.update(4)
            # Safety net: replay the first backbone. Anything left lazy before warm-up
            # rode along in the first graph only; the twin compiles here, not when serving.
            run_dummy(tokens[0], min(tokens[0], reqs[-1]))
            absorbed = self.compiled - start_graphs - plan
            if absorbed > 0:
                logger.warning("xla: warm-up compiled %d extra graph(s) (state left lazy before "
                               "warm-up); absorbed before serving", absorbed)
        bar.close()
        self.warmup_graphs = self.compiled - start_graphs
        self.warmup_seconds = time.perf_counter() - t0
        self.warm = True
        logger.info("xla: precompiled %d pieces, %d new graphs (%d token x %d request buckets) in %.1f s; "
                    "disk cache %s", plan, self.warmup_graphs, len(tokens), len(reqs), self.warmup_seconds,
                    ", ".join(f"{k} {v}" for k, v in self.warmup_cache.items()))

    # ---- pieces -------------------------------------------------------------------
    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """The backbone over one padded step. A host sync inside it raises `HostSyncError`: the
        capture guard refuses it while the lazy trace runs; under dynamo, fullgraph refuses it and
        the error is reported as the guard's (`host_sync.from_dynamo`)."""
        before, lookups = self._compile_count(), compile_cache.lookups()   # dynamo compiles inside the call
        args = (inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches)
        if self.mode == "dynamo":
            # The compiled step consumes the KV caches' donated buffers (`kv_update`): lazy work
            # still pending on them (an eager run of the model) must run first, or it would read
            # deleted buffers. Serving leaves nothing pending: then this sync runs no graph.
            self._torch_xla.sync()
        with no_grad_not_inference():
            try:
                with self._stance(skip_guards=self.warm):
                    hidden = self._call(*args)
            except RuntimeError as exc:   # a shape no bucket covers: dynamo compiles it (counted below)
                if "skip_guard_eval_unsafe" not in str(exc):
                    raise
                with self._stance(skip_guards=False):
                    hidden = self._call(*args)
            self._sync("backbone", {"tokens": int(inputs.input_ids.shape[0])}, before, lookups)
        return hidden

    def _call(self, *args: Any) -> torch.Tensor:
        """The forward, traced lazily inside the capture guard, or compiled by dynamo (whose
        refusal of a host sync becomes `HostSyncError`, chained to dynamo's error)."""
        if self.mode == "trace":
            with capture_guard(self.device):
                return self._forward(*args)
        try:
            return self._forward(*args)
        except RuntimeError as exc:
            sync = host_sync.from_dynamo(exc)
            if sync is None:
                raise
            raise sync from exc

    @contextlib.contextmanager
    def _stance(self, skip_guards: bool) -> Iterator[None]:
        """Once warm, dynamo evaluates only the guards that tell its entries (buckets) apart.
        Its global-state guard includes torch's thread count, which another engine of this
        process (the CPU backend) may change: the compiled entries run with the count they
        were traced with."""
        if self.mode != "dynamo":
            yield
            return
        threads = torch.get_num_threads()
        if threads != self._threads:
            torch.set_num_threads(self._threads)
        try:
            if skip_guards:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    yield
            else:
                yield
        finally:
            if threads != self._threads:
                torch.set_num_threads(threads)

    def _select(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        selected = hidden[indices]
        self._sync("select_hidden", {"tokens": int(hidden.shape[0]), "reqs": int(indices.shape[0])})
        return selected

    def _logits(self, selected: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(selected)
        self._sync("logits", {"reqs": int(selected.shape[0])})
        return logits

    def _sample(self, logits: torch.Tensor, si: SamplingInputs, all_greedy: bool) -> torch.Tensor:
        stop = self._dev(si.stop_ids)
        if all_greedy:
            tokens = sample_greedy(logits, stop)
        else:
            tokens = sample_random(logits, stop, *(self._dev(a) for a in si.random_args()))
        piece = "sample_greedy" if all_greedy else "sample_random"
        self._sync(piece, {"reqs": int(logits.shape[0])})
        return tokens

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor):
        k = min(self.max_logprobs, logits.shape[1])
        lp = topk_logprobs(logits, tokens, k)
        self._sync("logprobs", {"reqs": int(logits.shape[0]), "k": k})
        return lp

    def compute_logits(self, hidden: torch.Tensor, inputs: ModelInputs, num_reqs: int) -> torch.Tensor:
        """Logits of all `R_pad` padded rows (select and logits graphs per bucket)."""
        with no_grad_not_inference():
            return self._logits(self._select(hidden, inputs.logits_indices))

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample all `R_pad` padded rows with the precompiled graphs."""
        with no_grad_not_inference():
            si = build_sampling_inputs(meta.host_rows(), logits.shape[0], logits.shape[1], self.rng,
                                       STOP_WIDTH, self.max_logprobs)
            if si.host_only:
                return self._sample_on_host(logits, si)
            tokens = self._sample(logits, si, si.all_greedy)
            logprobs = None
            if si.max_logprobs >= 0:
                lp = self._logprobs(logits, tokens)
                logprobs = RowLogprobs(lp.token_ids, lp.logprobs, lp.ranks, si.num_logprobs)
            return SamplerOutput(tokens, logprobs)

    def _sample_on_host(self, logits: torch.Tensor, si: SamplingInputs) -> SamplerOutput:
        """Same functions on the host, for a step the graphs cannot hold (more stop ids
        than the graph's width, or more logprobs than its K); no compilation."""
        logits = logits.cpu()
        stop = torch.from_numpy(si.stop_ids)
        if si.all_greedy:
            tokens = sample_greedy(logits, stop)
        else:
            tokens = sample_random(logits, stop, *(torch.from_numpy(a) for a in si.random_args()))
        logprobs = None
        if si.max_logprobs >= 0:
            lp = topk_logprobs(logits, tokens, si.max_logprobs)
            logprobs = RowLogprobs(lp.token_ids, lp.logprobs, lp.ranks, si.num_logprobs)
        return SamplerOutput(tokens, logprobs)


@contextlib.contextmanager
def no_grad_not_inference():
    """no_grad instead of the runner's inference_mode: torch_xla's functionalization
    cannot handle inference tensors ("Cannot set version_counter for inference tensor")."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def _dummy_sampling(R: int, vocab: int) -> SamplingInputs:
    return SamplingInputs(
        all_greedy=True, stop_ids=np.full((R, STOP_WIDTH), vocab, np.int64),
        temperature=np.ones(R, np.float32), top_k=np.full(R, vocab, np.int64),
        top_p=np.ones(R, np.float32), min_p=np.zeros(R, np.float32), is_greedy=np.ones(R, bool),
        keys=np.zeros(R, np.int64), num_logprobs=np.full(R, -1, np.int64), max_logprobs=-1,
        host_only=False)
