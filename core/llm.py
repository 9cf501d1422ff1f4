"""The offline API in vLLM's shape: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Iterator, Sequence

from tqdm.auto import tqdm

from polyrunner.beam_search import BeamSearchOutput, beam_search
from polyrunner.chat_utils import (
    ChatTemplateContentFormat,
    conversations_of,
    format_content,
    render_kwargs,
    resolve_content_format,
)
from polyrunner.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_of,
)
from polyrunner.engine.llm_engine import LLMEngine
from polyrunner.llm_args import check_no_effect_args, note_trust_remote_code
from polyrunner.lora.request import LoRARequest
from polyrunner.outputs import RequestOutput
from polyrunner.prompt import Prompt
from polyrunner.sampling_params import BeamSearchParams, SamplingParams

LoRARequests = LoRARequest | Sequence[LoRARequest | None] | None

logger = logging.getLogger(__name__)


class LLM:
    """Load a model on a backend and generate.

    `model`: a local Hugging Face folder or .gguf file (None: the embedded default).
    `backend`: a registered backend name (None: the best available).
    The other arguments take vLLM's names: `gpu_memory_utilization` is the share of
    the device's free memory the KV cache may use (without kv_cache_memory_bytes),
    `num_gpu_blocks_override` fixes the number of KV blocks; `prefault_kv_cache` maps the
    KV cache's pages before steps touch them (what `polyrunner serve` does); `max_logprobs` caps
    `logprobs` / `prompt_logprobs` (-1: the whole vocabulary); `logprobs_mode` is
    what the sampled logprobs hold ("raw_logprobs", "raw_logits",
    "processed_logprobs", "processed_logits"); `scheduling_policy` "fcfs" or
    "priority" (with `generate(..., priority=[...])`); `max_num_seqs` and
    `max_num_batched_tokens` left None take the backend's defaults (vLLM's, by device:
    on CUDA 1024 and 16384 with >= 70 GiB of memory, else 256 and 8192; elsewhere 64
    and 2048; `Backend.default_limits`); `long_prefill_token_threshold`
    caps the tokens a prefill computes in one step (0: no cap); `async_scheduling`
    schedules and prepares the next step while the device runs this one (None: when
    the backend's `Capabilities.async_scheduling` allows it); `tensor_parallel_size`
    shards the model over that many devices, one process each (see
    `polyrunner.distributed.launch`; `shutdown()` stops them, as does exit);
    `data_parallel_size` > 1 runs that many engine replicas, each in its own process on
    its share of the host, and spreads the prompts over them (`polyrunner.engine.dp_engine`:
    an invalid prompt then comes back as an output with `error`, never a ValueError);
    `speculative_config` turns on speculative decoding, vLLM's dict form, e.g.
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
    "prompt_lookup_max": 4} (see `polyrunner.config.SpeculativeConfig`).
    `trust_remote_code` is accepted (True logs that it is not needed: no model code
    is run); vLLM's arguments that make no difference here (`tokenizer_mode`,
    `revision`, `swap_space`, ...) are accepted with the values polyrunner honours
    (see `polyrunner.llm_args`); `cudagraph_mode` (vLLM's names: "FULL",
    "FULL_DECODE_ONLY", "NONE"), `strict_no_recompile`, `token_buckets`,
    `request_buckets`, `usage_context` ("LLM_CLASS", or "OPENAI_API_SERVER" as
    `polyrunner serve` passes) go to `RunnerConfig`; any other keyword is a TypeError.
    """

    def __init__(self, model: str | None = None, backend: str | None = None, *,
                 dtype: str = default_of(ModelConfig, "dtype"),
                 quantization: str | None = None,
                 max_model_len: int | None = None,
                 max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 block_size: int | None = None,
                 kv_cache_memory_bytes: int | None = None,
                 gpu_memory_utilization: float = default_of(CacheConfig, "memory_utilization"),
                 num_gpu_blocks_override: int | None = None,
                 enable_prefix_caching: bool = default_of(CacheConfig, "enable_prefix_caching"),
                 prefault_kv_cache: bool = default_of(CacheConfig, "prefault_kv_cache"),
                 enable_chunked_prefill: bool = default_of(SchedulerConfig, "enable_chunked_prefill"),
                 long_prefill_token_threshold: int = default_of(SchedulerConfig, "long_prefill_token_threshold"),
                 scheduling_policy: str = default_of(SchedulerConfig, "policy"),
                 max_logprobs: int = default_of(ModelConfig, "max_logprobs"),
                 logprobs_mode: str = default_of(ModelConfig, "logprobs_mode"),
                 enforce_eager: bool = default_of(RunnerConfig, "enforce_eager"),
                 cudagraph_mode: str | None = default_of(RunnerConfig, "cudagraph_mode"),
                 seed: int = default_of(ModelConfig, "seed"),
                 tokenizer: str | None = None, async_scheduling: bool | None = None,
                 tensor_parallel_size: int = default_of(ParallelConfig, "tensor_parallel_size"),
                 data_parallel_size: int = default_of(ParallelConfig, "data_parallel_size"),
                 distributed_executor_backend: str | None = None,
                 speculative_config: dict | SpeculativeConfig | None = None,
                 enable_lora: bool = False, max_loras: int = default_of(LoRAConfig, "max_loras"),
                 max_lora_rank: int = default_of(LoRAConfig, "max_lora_rank"), max_cpu_loras: int | None = None,
                 trust_remote_code: bool = False, **kwargs: Any) -> None:
        given = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")} | kwargs
        note_trust_remote_code(trust_remote_code)
        runner_fields = set(RunnerConfig.model_fields) - {"backend", "enforce_eager", "cudagraph_mode"}
        runner_options = {k: v for k, v in kwargs.items() if k in runner_fields}
        check_no_effect_args({k: v for k, v in kwargs.items() if k not in runner_fields},
                             [*inspect.signature(LLM.__init__).parameters, *runner_fields])
        # unset limits stay unset: the backend's defaults fill them (`Backend.default_limits`)
        limits = {k: v for k, v in (("max_num_seqs", max_num_seqs),
                                    ("max_num_batched_tokens", max_num_batched_tokens)) if v is not None}
        # an unset block size stays unset: the backend may choose one (`Backend.adjust_config`), else 16
        blocks = {"block_size": block_size} if block_size is not None else {}
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, quantization=quantization, max_model_len=max_model_len,
                              seed=seed, tokenizer=tokenizer, max_logprobs=max_logprobs,
                              logprobs_mode=logprobs_mode),
            cache=CacheConfig(**blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
                              memory_utilization=gpu_memory_utilization,
                              num_blocks_override=num_gpu_blocks_override,
                              enable_prefix_caching=enable_prefix_caching, prefault_kv_cache=prefault_kv_cache),
            scheduler=SchedulerConfig(**limits, enable_chunked_prefill=enable_chunked_prefill,
                                      long_prefill_token_threshold=long_prefill_token_threshold,
                                      policy=scheduling_policy, async_scheduling=async_scheduling),
            runner=RunnerConfig(backend=backend, enforce_eager=enforce_eager, cudagraph_mode=cudagraph_mode,
                                **runner_options),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
                                    distributed_executor_backend=distributed_executor_backend),
            speculative=speculative_config,
            lora=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)
            if enable_lora else None)
        if data_parallel_size > 1:   # N engine processes; prompts spread by the server's router
            from polyrunner.engine.dp_engine import DPEngine
            self.engine = DPEngine(given, data_parallel_size, engine_of)
        else:
            self.engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers (nothing to do on one device)."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (None for a model without one), as vLLM's `LLM.get_tokenizer()`."""
        return self.engine.get_tokenizer()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequests = None, *,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A call whose every prompt is invalid raises ValueError (the first one's
        error, vLLM's wording, e.g. "The decoder prompt cannot be empty"). In a
        list with valid prompts, an invalid prompt gets an output with `error`
        set (finish_reason "error") and the others run.
        `priority`: one per prompt, with scheduling_policy="priority" (lower first).
        `lora_request`: the adapter for every prompt, or a list of one (or None) per prompt
        (needs `enable_lora=True`).
        """
        return self._generate(prompts, sampling_params, use_tqdm, priority, raise_all_invalid=True,
                              lora_request=lora_request)

    def _generate(self, prompts: Prompt | Sequence[Prompt],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: bool, priority: Sequence[int] | None, raise_all_invalid: bool,
                  lora_request: LoRARequests = None) -> list[RequestOutput]:
        prompt_list = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
        params = _broadcast(sampling_params, len(prompt_list))
        loras = _loras(lora_request, len(prompt_list))
        if priority is None:
            priority = [0] * len(prompt_list)
        elif len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        errors: list[tuple[int, ValueError]] = []
        for i, (prompt, p, prio, lora) in enumerate(zip(prompt_list, params, priority, loras)):
            try:
                order.append(self.engine.add_request(prompt, p, priority=prio, lora_request=lora))
            except ValueError as exc:
                rid = f"rejected-{i}"
                order.append(rid)
                outputs[rid] = _rejected(rid, prompt, exc)
                errors.append((i, exc))
        if raise_all_invalid and errors and len(errors) == len(order):
            raise errors[0][1]   # nothing was queued
        for i, exc in errors:
            logger.warning("prompt %d rejected: %s", i, exc)
        pending = len(order) - len(outputs)
        with tqdm(total=pending, desc="Processed prompts", disable=not use_tqdm or pending == 0) as bar:
            while self.engine.has_requests():
                for out in self.engine.step():
                    if out.finished:
                        outputs[out.request_id] = out
                        bar.update(1)
        return [outputs[rid] for rid in order]

    def generate_stream(self, prompts: Prompt | Sequence[Prompt],
                        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield partial outputs (cumulative text and tokens) as tokens arrive."""
        prompt_list = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
        ids: list[str] = []
        try:  # a bad prompt, or a caller that stops early, must not leak KV blocks
            for p, sp in zip(prompt_list, _broadcast(sampling_params, len(prompt_list))):
                ids.append(self.engine.add_request(p, sp, stream=True))
            while self.engine.has_requests():
                yield from self.engine.step()
        finally:
            for rid in ids:
                self.engine.abort_request(rid)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's offline beam search on top of `generate` (see `polyrunner.beam_search`).
        Returns per prompt the `beam_width` best sequences, best first; an invalid
        prompt gets no sequences (all prompts invalid: ValueError).
        `concurrency_limit`: at most that many prompts are searched at once, in
        chunks of that size in prompt order (None: all); the results are the same.
        `lora_request`: vLLM's; only None (beam search runs the base model)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {_kind(params, 'BeamSearchParams')}")
        if lora_request is not None:
            raise ValueError("lora_request is not supported by beam_search: it runs the base model (pass None)")
        tokenizer = self.get_tokenizer()
        eos = tokenizer.eos_token_id if tokenizer is not None else next(iter(self.engine.arch.eos_token_ids), None)

        def generate(prompt_list: list[Prompt], step_params: SamplingParams, first: bool) -> list[RequestOutput]:
            return self._generate(prompt_list, step_params, False, None, raise_all_invalid=first)

        prompt_list = list(prompts) if isinstance(prompts, (list, tuple)) else [prompts]
        return beam_search(generate, prompt_list, params, eos, self.engine.max_model_len, tokenizer, use_tqdm,
                           concurrency_limit)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: ChatTemplateContentFormat = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: render each conversation with the chat template, then generate.

        `messages`: one conversation (a list of message dicts) or a list of them;
        `sampling_params`: one for all conversations, or a list of one each;
        `chat_template`: a template string instead of the model's;
        `chat_template_content_format`: "string" / "openai" / "auto" (see
        `polyrunner.chat_utils.resolve_content_format`);
        `add_generation_prompt`: end with the assistant turn's header;
        `continue_final_message`: leave the last message open so generation continues it
        (needs add_generation_prompt=False, as in vLLM); `tools`: the template's `tools`;
        `chat_template_kwargs`: more template variables (not "chat_template" / "tokenize";
        the named arguments win). The prompt text equals transformers'
        `apply_chat_template(..., tokenize=False)` for the same arguments.
        `lora_request`: as for `generate`; `mm_processor_kwargs`: vLLM's; only None (text models)."""
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs is not supported: polyrunner runs text-only models")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = conversations_of(messages)
        params = _broadcast(sampling_params, len(conversations))   # a bad argument fails before templating
        options = render_kwargs(chat_template_kwargs, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, tools=tools)
        template = chat_template if chat_template is not None else self.tokenizer.chat_template
        content_format = resolve_content_format(template, chat_template_content_format)
        texts = [self.tokenizer.apply_chat_template(format_content(c, content_format), chat_template=chat_template,
                                                    **options) for c in conversations]
        prompts = [{"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
                   for text in texts]
        return self.generate(prompts, params, use_tqdm=use_tqdm, lora_request=lora_request)


def engine_of(llm_kwargs: dict[str, Any]) -> LLMEngine:
    """`LLM(**llm_kwargs)`'s engine: what an engine process builds (module level: it pickles by reference)."""
    engine: LLMEngine = LLM(**llm_kwargs).engine
    return engine


def _loras(lora_request: LoRARequests, n: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt: vLLM's rule, as for sampling params."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest or a list of them (one per prompt), got "
                        f"{type(lora_request).__name__}")
    for i, r in enumerate(lora_request):
        if r is not None and not isinstance(r, LoRARequest):
            raise TypeError(f"lora_request[{i}] must be a LoRARequest or None, got {type(r).__name__}")
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} lora_requests for {n} prompts")
    return list(lora_request)


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt (vLLM's rule: one for all, or a list of one per prompt)."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise TypeError("sampling_params must be a SamplingParams or a list of SamplingParams (one per prompt), "
                        f"got {_kind(params)}")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {_kind(p)}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return list(params)


def _kind(value: object, expected: str = "SamplingParams") -> str:
    """What a caller passed, with the fix for the usual mistake (a dict of parameters)."""
    hint = f" (pass {expected}(**that_dict))" if isinstance(value, dict) else ""
    return f"{type(value).__name__}{hint}"


def _rejected(rid: str, prompt: Prompt, exc: Exception) -> RequestOutput:
    from polyrunner.outputs import CompletionOutput
    text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
    given = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    ids = list(given) if isinstance(given, (list, tuple)) else []   # as given: it may be what was wrong
    return RequestOutput(rid, text, ids, outputs=[CompletionOutput(0, "", [], finish_reason="error")],
                         finished=True, error=str(exc))
