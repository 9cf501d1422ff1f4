"""Shared state of one conformance run: the backend under test, the tiny
model folder, engines built on demand (and cached), the CPU reference.

Engines are expensive on compiling backends, so each configuration is built
once per run and shared by the checks that need it; a configuration that
fails to build is remembered, and every check needing it errors with the
build error instead of rebuilding.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from polyrunner.numeric import round_up

REFERENCE_BACKEND = "cpu"
MAX_ENGINE_STEPS = 5000
MAX_POSITIONS = 4096   # the tiny model's: room for max_model_len at any block size the run scales to


@dataclass
class ConformanceSettings:
    """Sizes of the run. Defaults keep one backend's run well under a minute on 2 CPU cores."""

    max_num_seqs: int = 4
    max_num_batched_tokens: int = 64
    chunked_max_num_batched_tokens: int = 16
    block_size: int | None = None        # None: the backend's own (its adjust_config's), else 16
    max_model_len: int = 128             # at 16-token blocks; scaled with the block size (`ConformanceContext.scale`)
    kv_blocks: int = 64                  # blocks the main engines' budget buys
    preempt_blocks: int = 6              # incl. the null block: forces preemption
    max_tokens: int = 10
    num_prompts: int = 6
    max_bucket_pairs: int = 8            # execution: buckets compared (smallest, largest, sampled)
    stream_requests: int = 10            # execution: random requests for the no-recompile stream
    memory_runs: int = 3                 # hygiene: measured repeats after warm-up
    seed: int = 0
    # (max_num_seqs, max_num_batched_tokens) combinations the bucket checks enumerate.
    bucket_configs: tuple[tuple[int, int], ...] = ((4, 64), (3, 20), (1, 8), (8, 200), (16, 512))
    extra: dict[str, Any] = field(default_factory=dict)


class EngineBuildError(RuntimeError):
    pass


class ConformanceContext:
    def __init__(self, backend: str, settings: ConformanceSettings | None = None,
                 workdir: str | None = None) -> None:
        self.backend_name = backend
        self.settings = settings or ConformanceSettings()
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="polyrunner-conformance-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._engines: dict[str, Any] = {}
        self._engine_errors: dict[str, str] = {}
        self._blocker: str | None = None
        self.cache: dict[str, Any] = {}   # results shared between checks (e.g. reference tokens)
        self.results: dict[str, Any] = {}  # CheckResult by check id, this run's so far (prerequisites)

    def __enter__(self) -> "ConformanceContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._engines.clear()
        self.cache.clear()
        gc.collect()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ---- the backend under test ------------------------------------------------
    @property
    def backend_cls(self):
        from polyrunner.plugins.manager import backend_classes
        return backend_classes().get(self.backend_name)

    @property
    def capabilities(self):
        cls = self.backend_cls
        return None if cls is None else cls.capabilities

    def blocker(self) -> str:
        """Why checks past registration cannot run here ('' when they can)."""
        if self._blocker is None:
            from polyrunner.plugins.manager import _broken, _probe, backend_classes
            classes = backend_classes()
            cls = classes.get(self.backend_name)
            if cls is None:
                why = _broken.get(self.backend_name)
                self._blocker = (f"backend {self.backend_name!r} " + (why or "is not registered; known: "
                                 + ", ".join(sorted(classes))))
            else:
                a = _probe(cls)
                self._blocker = "" if a.available else f"backend {self.backend_name!r} is unavailable here: {a.reason}"
        return self._blocker

    def new_backend(self, **overrides):
        """A backend instance, as an engine makes it (`create_backend`): from `make_config(**overrides)`
        after the backend's `adjust_config`."""
        from polyrunner.plugins import create_backend
        return create_backend(self.make_config(**overrides))

    @cached_property
    def dtype_name(self) -> str:
        """float32 when the backend runs it (exact comparisons), else its default dtype (the first it
        declares when the default is not among them)."""
        import torch
        declared = self.capabilities.dtypes
        if torch.float32 in declared:
            return "float32"
        default = self.new_backend(dtype="auto").default_dtype
        return str(default if default in declared else declared[0]).removeprefix("torch.")

    @cached_property
    def block_size(self) -> int:
        """The KV block size the run uses: the settings', else the one the backend's `adjust_config`
        gives a configuration that leaves it unset (16 unless the backend says otherwise)."""
        if self.settings.block_size is not None:
            return self.settings.block_size
        cfg = self.make_config(dtype="auto", max_model_len=self.settings.max_model_len)
        self.backend_cls.adjust_config(cfg)
        return int(cfg.cache.block_size)

    @property
    def scale(self) -> int:
        """Block size / 16 (at least 1): prompt lengths and max_model_len grow with it, so that
        prompts still span several blocks and a small pool still preempts."""
        return max(1, self.block_size // 16)

    # ---- model and configs --------------------------------------------------------
    @cached_property
    def model_dir(self) -> Path:
        from polyrunner.tools.conformance.tiny_llama import write_tiny_llama
        return write_tiny_llama(self.workdir / "tiny-llama", seed=self.settings.seed,
                                max_position_embeddings=MAX_POSITIONS)

    @cached_property
    def arch(self):
        import json

        from polyrunner.models.arch import DecoderArch
        return DecoderArch.from_hf_config(json.loads((self.model_dir / "config.json").read_text()))

    def kv_spec(self, block_size: int | None = None, dtype=None):
        import torch

        from polyrunner.device.kv_spec import KVCacheSpec
        a = self.arch
        return KVCacheSpec(a.num_layers, block_size or self.block_size, a.num_kv_heads,
                           a.head_dim, dtype or getattr(torch, self.dtype_name))

    def kv_budget_bytes(self, blocks: int, alignment: int) -> int:
        """A byte budget buying `blocks` blocks per layer under `alignment` (with alignment > 1, room
        for a layout that aligns K and V separately and the buffer's address: two more alignments)."""
        spec = self.kv_spec()
        per_layer = blocks * spec.page_size_bytes
        per_layer = round_up(per_layer, alignment) + (2 * alignment if alignment > 1 else 0)
        return per_layer * spec.num_layers

    def make_config(self, backend: str | None = None, **overrides):
        """An EngineConfig for the tiny model, as validated (before any `Backend.adjust_config`).
        `overrides`: flat names of the sub-config fields (max_num_seqs, block_size,
        kv_cache_memory_bytes, ...). The block size is left unset (the backend's default) unless
        the settings or `overrides` give one."""
        from polyrunner.config import (
            CacheConfig,
            EngineConfig,
            ModelConfig,
            ParallelConfig,
            RunnerConfig,
            SchedulerConfig,
        )
        s = self.settings
        o = dict(overrides)
        block = {"block_size": o.pop("block_size", s.block_size)}
        cfg = EngineConfig(
            model=ModelConfig(model=str(self.model_dir), dtype=o.pop("dtype") if "dtype" in o else self.dtype_name,
                              max_model_len=o.pop("max_model_len") if "max_model_len" in o else self.max_model_len,
                              seed=s.seed),
            cache=CacheConfig(**{k: v for k, v in block.items() if v is not None},
                              kv_cache_memory_bytes=o.pop("kv_cache_memory_bytes", None),
                              enable_prefix_caching=o.pop("enable_prefix_caching", True),
                              num_blocks_override=o.pop("num_blocks_override", None)),
            scheduler=SchedulerConfig(max_num_seqs=o.pop("max_num_seqs", s.max_num_seqs),
                                      max_num_batched_tokens=o.pop("max_num_batched_tokens",
                                                                   s.max_num_batched_tokens),
                                      async_scheduling=o.pop("async_scheduling", None)),
            parallel=ParallelConfig(tensor_parallel_size=o.pop("tensor_parallel_size", 1)),
            speculative=o.pop("speculative", None), lora=o.pop("lora", None),
            runner=RunnerConfig(backend=backend or self.backend_name, **o))
        return cfg

    @property
    def max_model_len(self) -> int:
        return self.settings.max_model_len * self.scale

    def device_count(self) -> int:
        """Devices of the backend's kind on this host (`Backend.device_count`)."""
        return self.backend_cls.device_count()

    def engine_config(self, key: str):
        s = self.settings
        align = self.backend_cls.kv_alignment_bytes if key != "reference" else 1
        budget = self.kv_budget_bytes(s.kv_blocks, align)
        if key == "exec":       # execution checks write KV directly: no prefix cache to poison
            return self.make_config(kv_cache_memory_bytes=budget, enable_prefix_caching=False)
        if key == "e2e":
            return self.make_config(kv_cache_memory_bytes=budget)
        if key == "chunked":
            return self.make_config(kv_cache_memory_bytes=budget,
                                    max_num_batched_tokens=s.chunked_max_num_batched_tokens)
        if key == "preempt":
            return self.make_config(num_blocks_override=s.preempt_blocks, enable_prefix_caching=False)
        if key in ("async", "sync"):   # chunked prefill and preemption, scheduled both ways
            return self.make_config(num_blocks_override=s.preempt_blocks, async_scheduling=key == "async",
                                    max_num_batched_tokens=s.chunked_max_num_batched_tokens)
        if key == "reference":
            return self.make_config(REFERENCE_BACKEND, kv_cache_memory_bytes=budget)
        raise KeyError(key)

    def engine(self, key: str):
        """The engine for configuration `key` (exec, e2e, chunked, preempt, async, sync,
        reference), built once."""
        if key in self._engine_errors:
            raise EngineBuildError(self._engine_errors[key])
        if key not in self._engines:
            from polyrunner.engine.llm_engine import LLMEngine
            try:
                self._engines[key] = LLMEngine(self.engine_config(key))
            except Exception as exc:
                self._engine_errors[key] = f"building the {key!r} engine failed: {type(exc).__name__}: {exc}"
                raise EngineBuildError(self._engine_errors[key]) from exc
        return self._engines[key]

    # ---- prompts and generation ------------------------------------------------------
    def prompts(self) -> list[list[int]]:
        """Random prompts of assorted lengths, in blocks (`scale`: the same block counts at any
        block size), one of a single token, two sharing a two-block prefix so the prefix cache
        is exercised."""
        if "prompts" not in self.cache:
            s = self.settings
            rng = np.random.default_rng(s.seed + 1)
            vocab = self.arch.vocab_size
            lengths = [5, 17, 1, 48, 33, 40, 12, 26][: s.num_prompts]   # at 16-token blocks
            prompts = [rng.integers(3, vocab, size=n if n == 1 else n * self.scale).tolist() for n in lengths]
            if len(prompts) > 4:
                shared = 2 * self.block_size
                prompts[4] = prompts[3][:shared] + prompts[4][: max(1, len(prompts[4]) - shared)]
            self.cache["prompts"] = prompts
        return self.cache["prompts"]

    def reference_tokens(self) -> list[list[int]]:
        """Greedy tokens of `prompts()` on the CPU reference backend, in the dtype
        the backend under test runs (float32 whenever it supports it)."""
        if "reference_tokens" not in self.cache:
            from polyrunner.sampling_params import SamplingParams
            params = SamplingParams(temperature=0.0, max_tokens=self.settings.max_tokens, ignore_eos=True,
                                    logprobs=2)
            outs = generate_outputs(self.engine("reference"), self.prompts(), params)
            self.cache["reference_tokens"] = [list(c.token_ids) for c in outs]
            self.cache["reference_logprobs"] = [list(c.logprobs or []) for c in outs]
        return self.cache["reference_tokens"]

    def reference_logprobs(self) -> list[list[dict[int, Any]]]:
        """The reference's top-2 logprobs at each output token of `reference_tokens()`."""
        self.reference_tokens()
        return self.cache["reference_logprobs"]


def generate(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Run `prompts` to completion on `engine`; token ids per prompt, in order.
    `params`: one SamplingParams or one per prompt."""
    return [list(c.token_ids) for c in generate_outputs(engine, prompts, params)]


def generate_outputs(engine, prompts: list[list[int]], params) -> list[Any]:
    """`generate`, returning each prompt's finished `CompletionOutput` (tokens, logprobs)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, plist)]
    done: dict[str, Any] = {}
    for _ in range(MAX_ENGINE_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    else:
        raise AssertionError(f"the engine did not finish {len(prompts)} requests in {MAX_ENGINE_STEPS} steps")
    missing = [i for i in ids if i not in done]
    if missing:
        raise AssertionError(f"requests {missing} never reported a finished output")
    return [done[i] for i in ids]
