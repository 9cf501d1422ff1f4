"""The offline API in vLLM's shape: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

from tqdm.auto import tqdm

from polyrunner.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from polyrunner.engine.llm_engine import LLMEngine, Prompt
from polyrunner.outputs import RequestOutput
from polyrunner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """Load a model on a backend and generate.

    `model`: a local Hugging Face folder or .gguf file (None: the embedded default).
    `backend`: a registered backend name (None: the best available).
    """

    def __init__(self, model: str | None = None, backend: str | None = None, *, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, block_size: int = 16,
                 kv_cache_memory_bytes: int | None = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, enforce_eager: bool = False, seed: int = 0,
                 tokenizer: str | None = None, **runner_options) -> None:
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                              tokenizer=tokenizer),
            cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill),
            runner=RunnerConfig(backend=backend, enforce_eager=enforce_eager, **runner_options))
        self.engine = LLMEngine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A single invalid prompt raises ValueError. In a list, an invalid prompt
        gets an output with `error` set (finish_reason "error") and the others run.
        """
        single = not isinstance(prompts, (list, tuple))
        prompt_list = [prompts] if single else list(prompts)
        params = _broadcast(sampling_params, len(prompt_list))
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompt_list, params)):
            try:
                order.append(self.engine.add_request(prompt, p))
            except ValueError as exc:
                if single:
                    raise
                rid = f"rejected-{i}"
                order.append(rid)
                outputs[rid] = _rejected(rid, prompt, exc)
                logger.warning("prompt %d rejected: %s", i, exc)
        pending = len(order) - len(outputs)
        with tqdm(total=pending, desc="Processed prompts", disable=not use_tqdm or pending == 0) as bar:
            while self.engine.has_unfinished_requests():
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
            while self.engine.has_unfinished_requests():
                yield from self.engine.step()
        finally:
            for rid in ids:
                self.engine.abort_request(rid)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
                   for text in (self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                                for c in conversations)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params


def _rejected(rid: str, prompt: Prompt, exc: Exception) -> RequestOutput:
    from polyrunner.outputs import CompletionOutput
    text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
    ids = list(prompt.get("prompt_token_ids", [])) if isinstance(prompt, dict) else []
    return RequestOutput(rid, text, ids, [CompletionOutput(0, "", [], finish_reason="error")],
                         finished=True, error=str(exc))
