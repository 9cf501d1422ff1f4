"""Validated engine configuration (pydantic).

Four small configs, one per concern, bundled in `EngineConfig`. Every field
names its allowed range; pydantic's error names the field that broke it.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from polyrunner import envs

DType = Literal["auto", "float32", "bfloat16", "float16"]
# What `Logprob.logprob` holds (vLLM's `logprobs_mode`): "raw" = the model's logits before
# any logits processor, "processed" = after processors, penalties, temperature, top-k/top-p
# and min-p (the distribution the token was sampled from); "logprobs" are log-softmaxed.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
SchedulingPolicy = Literal["fcfs", "priority"]
# vLLM's `CUDAGraphMode` names a graph-capturing backend honours (polyrunner.device.graph_buckets)
GraphMode = Literal["NONE", "FULL_DECODE_ONLY", "FULL"]
GRAPH_MODES: tuple[str, ...] = get_args(GraphMode)
# Who builds the engine (vLLM's `UsageContext` names): device-dependent scheduler defaults
# (`Backend.default_limits`) differ for the offline `LLM` class and the OpenAI-compatible server.
UsageContext = Literal["LLM_CLASS", "OPENAI_API_SERVER"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """Where the weights come from and how they are held."""

    model: str | None = Field(
        default=None, description="Local Hugging Face folder or .gguf file; None: embedded default")
    dtype: DType = "auto"
    quantization: Literal["gguf"] | None = Field(
        default=None, description="vLLM's `quantization`: None runs a quantized checkpoint (GGUF) quantized when the "
        "backend executes its format and dtype is auto, dequantised otherwise; \"gguf\" demands quantized execution")
    max_model_len: int | None = Field(default=None, ge=1, description="None: the model's own limit")
    seed: int = Field(default=0, ge=0, description="engine seed for requests without their own")
    tokenizer: str | None = None
    max_logprobs: int = Field(default=20, ge=-1, description="most logprobs / prompt_logprobs a request may ask "
                              "for (vLLM's default 20); -1: the whole vocabulary")
    logprobs_mode: LogprobsMode = "raw_logprobs"


class CacheConfig(_Strict):
    """Paged KV cache: block size and memory budget."""

    block_size: int = Field(default=16, ge=1, le=1024)
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1)
    memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = Field(default=None, ge=2)
    prefault_kv_cache: bool = Field(default=False, description="map every page of the KV cache before the "
                                    "steps touch it (a backend whose cache is host memory does it in a background "
                                    "thread): for a long-running server, so no step pays a first-touch page fault; "
                                    "False: pages fault in as blocks are first used")


class SchedulerConfig(_Strict):
    """Continuous batching limits. `max_num_seqs` and `max_num_batched_tokens` left unset
    (not passed) take the backend's `default_limits` first (vLLM's device-dependent defaults;
    e.g. CUDA with >= 70 GiB: 1024 and 16384, LLM class), else the defaults here."""

    max_num_seqs: int = Field(default=64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    policy: SchedulingPolicy = Field(default="fcfs", description="fcfs: arrival order; priority: lower "
                                     "`priority` first (ties by arrival), preempting the lowest-priority")
    async_scheduling: bool | None = Field(default=None, description="schedule and prepare step N+1 while "
                                          "step N runs on the device (vLLM's name); None: the backend's "
                                          "`Capabilities.async_scheduling`")
    grammar_compile_timeout_s: float = Field(
        default_factory=lambda: envs.GRAMMAR_COMPILE_TIMEOUT_S.get(), gt=0,
        description="seconds a structured-output request may wait for its grammar (compiled in a worker "
        "pool, off the step; queueing counts); past it the request fails alone with a ValueError (HTTP 400). "
        "Default: env POLYRUNNER_GRAMMAR_COMPILE_TIMEOUT_S, else 10")


class ParallelConfig(_Strict):
    """How many devices share the model."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=512, description="ranks the model is sharded over "
                                      "(vLLM's name): heads, MLP rows and the vocabulary split; one process each")
    data_parallel_size: int = Field(default=1, ge=1, le=64, description="engine replicas (vLLM's name), each "
                                    "with its own tensor-parallel group, behind one frontend that routes requests")
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        default=None, description="how tensor-parallel workers start (vLLM's name): \"mp\" (processes spawned on "
        "this host, or torchrun's), \"ray\" (Ray actors in a placement group; `polyrunner[ray]`); None: \"mp\"")


class RunnerConfig(_Strict):
    """How the backend executes the model."""

    @field_validator("cudagraph_mode", mode="before")
    @classmethod
    def _check_cudagraph_mode(cls, value: Any) -> Any:
        if value is None:
            return None
        name = getattr(value, "name", value)   # vLLM's CUDAGraphMode enum, or its name
        if isinstance(name, str) and name.upper() in GRAPH_MODES:
            return name.upper()
        why = (" (piecewise graphs need torch.compile's graph split, which polyrunner does not do)"
               if isinstance(name, str) and "PIECEWISE" in name.upper() else "")
        raise ValueError(f"runner.cudagraph_mode must be one of {', '.join(map(repr, GRAPH_MODES))} or None "
                         f"(the backend's default), got {value!r}{why}")

    backend: str | None = Field(default=None, description="None: best available")
    enforce_eager: bool = False
    cudagraph_mode: GraphMode | None = Field(
        default=None, description="vLLM's `compilation_config.cudagraph_mode`, for graph-capturing backends: "
        "\"FULL_DECODE_ONLY\" (graphs of decode steps), \"FULL\" (also of mixed prefill+decode steps; needs a "
        "length-adaptive attention, else FULL_DECODE_ONLY), \"NONE\" (no graphs); None: the backend's default. "
        "enforce_eager=True means NONE")
    strict_no_recompile: bool = False
    token_buckets: list[int] | None = None
    request_buckets: list[int] | None = None
    usage_context: UsageContext = Field(default="LLM_CLASS", description="who builds the engine (vLLM's name): "
                                        "selects the backend's default scheduler limits; `polyrunner serve` "
                                        "passes OPENAI_API_SERVER")


class SpeculativeConfig(_Strict):
    """Speculative decoding (vLLM's `speculative_config` names). "ngram": prompt lookup,
    drafts copied from the request's own tokens after the last occurrence of its
    trailing n-gram (n from prompt_lookup_max down to prompt_lookup_min)."""

    method: Literal["ngram"] = Field(default="ngram", description="how drafts are proposed; \"ngram\" "
                                     "(prompt lookup); a draft model (EAGLE, a small LM) plugs in as a "
                                     "`polyrunner.spec_decode.Proposer`")
    num_speculative_tokens: int = Field(ge=1, le=32, description="draft tokens proposed per request per step")
    prompt_lookup_min: int = Field(default=2, ge=1, le=64, description="shortest n-gram looked up")
    prompt_lookup_max: int = Field(default=4, ge=1, le=64, description="longest n-gram looked up")

    @model_validator(mode="after")
    def _check_lookup(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


# vLLM's allowed `max_lora_rank` values
LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoRAConfig(_Strict):
    """Multi-LoRA (vLLM's `enable_lora` arguments): `max_loras` adapters resident on the device
    (the most distinct adapters in one step), each of rank <= `max_lora_rank`; `max_cpu_loras`
    adapters kept read in host memory (None: max_loras)."""

    max_loras: int = Field(default=1, ge=1, le=256)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = Field(default=None, ge=1)

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, v: int) -> int:
        if v not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {v}")
        return v

    @model_validator(mode="after")
    def _cpu_cache(self) -> "LoRAConfig":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


class EngineConfig(_Strict):
    model: ModelConfig
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    runner: RunnerConfig = RunnerConfig()
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None   # None: LoRA disabled (vLLM's enable_lora=False)

    @model_validator(mode="after")
    def _check_budget(self) -> "EngineConfig":
        sched = self.scheduler
        if not sched.enable_chunked_prefill and self.model.max_model_len is not None:
            if sched.max_num_batched_tokens < self.model.max_model_len:
                raise ValueError(
                    "scheduler.max_num_batched_tokens must be >= max_model_len "
                    f"({self.model.max_model_len}) when chunked prefill is disabled"
                )
        return self


def default_of(config: type[BaseModel], name: str) -> Any:
    """The default of field `name` of a config class: the one home of every engine default
    (`LLM(...)`'s keyword arguments and the command line's options read it from here)."""
    return config.model_fields[name].default
