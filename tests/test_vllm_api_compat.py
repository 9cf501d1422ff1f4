"""vLLM offline-API shapes that vLLM's own e2e tests use: `LLM.chat`'s template arguments
(transformers' `apply_chat_template` is the oracle for the prompt text),
`LLM.beam_search(concurrency_limit=)`, `RequestOutput`'s forward-compatible keywords,
and vLLM's `LLM(...)` arguments that make no difference to polyrunner."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging

import pytest

transformers = pytest.importorskip("transformers")

from polyrunner import LLM, CompletionOutput, RequestOutput, SamplingParams  # noqa: E402
from polyrunner.lora.request import LoRARequest  # noqa: E402
from polyrunner.sampling_params import BeamSearchParams  # noqa: E402
from test_stop_strings_engine import make_tokenizer_folder  # noqa: E402

# SmolLM2-Instruct's template (the embedded default model's), verbatim
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen2.5's tool-calling template (its tools preamble shortened, to fit the tiny model) plus Qwen3's
# enable_thinking switch
TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or """ \
"""(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
# a template that reads OpenAI's list-of-parts content
PARTS_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{% for part in m['content'] %}"
                  "{% if part['type'] == 'text' %}<t>{{ part['text'] }}</t>{% endif %}{% endfor %}\n"
                  "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "<now> & \"later\"",
                                           "parameters": {"city": "string"}}}]
CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}]
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def folder(tiny_model_factory, tmp_path_factory):
    base, _ = tiny_model_factory("llama")
    out = make_tokenizer_folder(base, tmp_path_factory.mktemp("compat-tok"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=SMOL_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), backend="cpu", dtype="float32", max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def ref(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@contextlib.contextmanager
def captured(name: str, level: int = logging.INFO):
    """Records of logger `name` (works whether or not polyrunner's logging is configured)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger(name)
    handler, old = Keep(level), log.level
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(old)


def _chat_prompt(llm, messages, **kwargs) -> RequestOutput:
    (out,) = llm.chat(messages, ONE_TOKEN, use_tqdm=False, **kwargs)
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    return out


# ------------------------------------------------------------------------ LLM.chat


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompt_is_transformers_render(llm, ref, add_generation_prompt):
    out = _chat_prompt(llm, CHAT, add_generation_prompt=add_generation_prompt)
    want = ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert out.prompt == want
    assert want.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert out.prompt_token_ids == ref.encode(want, add_special_tokens=False)


def test_continue_final_message_leaves_the_last_message_open(llm, ref):
    messages = CHAT + [{"role": "assistant", "content": "The capital of Italy is"}]
    out = _chat_prompt(llm, messages, add_generation_prompt=False, continue_final_message=True)
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                   continue_final_message=True)
    assert out.prompt == want and want.endswith("<|im_start|>assistant\nThe capital of Italy is")
    # as vLLM (transformers' check): the default add_generation_prompt=True excludes it
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt are not compatible"):
        llm.chat(messages, ONE_TOKEN, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt are not compatible"):
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, continue_final_message=True)


def test_chat_takes_a_list_of_conversations(llm, ref):
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    outs = llm.chat([CHAT, second], ONE_TOKEN, use_tqdm=False)
    assert [o.prompt for o in outs] == [ref.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                                         for c in (CHAT, second)]


def test_tools_and_chat_template_kwargs_reach_the_template(llm, ref):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,   # OpenAI's shape: None keys are dropped, as transformers does
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "user", "content": "Ok"}]
    for kwargs in ({}, {"enable_thinking": False}):
        out = _chat_prompt(llm, messages, chat_template=TOOLS_TEMPLATE, tools=TOOLS,
                           chat_template_kwargs=kwargs or None)
        want = ref.apply_chat_template(messages, tools=TOOLS, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                       add_generation_prompt=True, **kwargs)
        assert out.prompt == want
        assert '"name": "get_weather"' in want and "<tool_response>" in want
        assert want.endswith("<think>\n\n</think>\n\n") == bool(kwargs)
    # without tools the same template renders its plain system prompt
    plain = _chat_prompt(llm, CHAT, chat_template=TOOLS_TEMPLATE)
    assert plain.prompt == ref.apply_chat_template(CHAT, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                                   add_generation_prompt=True)
    assert "# Tools" not in plain.prompt


def test_chat_template_kwargs_cannot_override_reserved_names(llm):
    for name in ("chat_template", "tokenize"):
        with pytest.raises(ValueError, match="Found unexpected chat template kwargs from request: .*" + name):
            llm.chat(CHAT, ONE_TOKEN, chat_template_kwargs={name: "x"})
    # the named arguments win over the same names in chat_template_kwargs (vLLM's merge)
    out = _chat_prompt(llm, CHAT, add_generation_prompt=True, chat_template_kwargs={"add_generation_prompt": False})
    assert out.prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_content_format(llm, ref):
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    # "auto" with a template that reads content as a string: the parts' text joined (vLLM's "string")
    for fmt in ("auto", "string"):
        out = _chat_prompt(llm, parts, chat_template_content_format=fmt)
        assert out.prompt == ref.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    # "auto" with a template that loops over the parts: string content becomes parts (vLLM's "openai")
    listed = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    for fmt in ("auto", "openai"):
        out = _chat_prompt(llm, [{"role": "user", "content": "hello"}], chat_template=PARTS_TEMPLATE,
                           chat_template_content_format=fmt)
        assert out.prompt == ref.apply_chat_template(listed, chat_template=PARTS_TEMPLATE, tokenize=False,
                                                     add_generation_prompt=True) == "[user]<t>hello</t>[assistant]"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(CHAT, ONE_TOKEN, chat_template_content_format="markdown")
    with pytest.raises(ValueError, match="content part of type 'image_url' is not supported"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ONE_TOKEN)


def test_chat_positional_arguments_follow_vllm(llm, ref):
    """vLLM's order: messages, sampling_params, use_tqdm, lora_request, chat_template, ..."""
    (out,) = llm.chat(CHAT, ONE_TOKEN, False, None, TOOLS_TEMPLATE, "auto", False)
    assert out.prompt == ref.apply_chat_template(CHAT, chat_template=TOOLS_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=False)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.chat(CHAT, ONE_TOKEN, lora_request=object())
    with pytest.raises(ValueError, match="LoRA is not enabled"):   # an engine without enable_lora
        llm.chat(CHAT, ONE_TOKEN, lora_request=LoRARequest("adapter", 1, "/no/such/folder"))
    with pytest.raises(ValueError, match="mm_processor_kwargs is not supported"):
        llm.chat(CHAT, ONE_TOKEN, mm_processor_kwargs={"num_crops": 4})


# ------------------------------------------------------------------ LLM.beam_search


def _beams(outs):
    return [[(s.tokens, s.finish_reason, s.text) for s in o.sequences] for o in outs]


def test_beam_search_concurrency_limit_gives_the_same_result(llm):
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(t)} for t in
               ("kato rime su", "la pe di qu zo", "an el", "or is ut st op he")]
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    whole = llm.beam_search(prompts, params)
    for limit in (1, 2, 3, 4, 10):
        chunked = llm.beam_search(prompts, params, concurrency_limit=limit)
        assert _beams(chunked) == _beams(whole), limit
        for a, b in zip(chunked, whole):
            assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences],
                                                                        abs=1e-4)
    # vLLM's positional order: prompts, params, lora_request, use_tqdm, concurrency_limit
    assert _beams(llm.beam_search(prompts, params, None, False, 2)) == _beams(whole)


def test_beam_search_concurrency_limit_errors(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    ok = {"prompt_token_ids": [5, 6, 7]}
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="concurrency_limit must be an integer >= 1 or None"):
            llm.beam_search([ok], params, concurrency_limit=bad)
    with pytest.raises(ValueError, match="lora_request is not supported"):
        llm.beam_search([ok], params, lora_request="adapter")
    empty = {"prompt_token_ids": []}
    # every prompt invalid: the first one's error, whatever the chunking
    for limit in (None, 1):
        with pytest.raises(ValueError, match="The decoder prompt cannot be empty"):
            llm.beam_search([empty, empty], params, concurrency_limit=limit)
    # an invalid prompt in its own chunk gets no sequences; the others run
    outs = llm.beam_search([empty, ok], params, concurrency_limit=1)
    assert outs[0].sequences == [] or all(s.tokens == [] for s in outs[0].sequences)
    assert len(outs[1].sequences) == 2
    with captured("polyrunner.beam_search", logging.WARNING) as records:
        llm.beam_search([ok], params, use_tqdm=True, concurrency_limit=1)
    assert any("Progress bar is not supported when using concurrency_limit" in r.getMessage() for r in records)


# ------------------------------------------------------------------- RequestOutput


def test_request_output_takes_forward_compatible_keywords():
    with captured("polyrunner.outputs", logging.WARNING) as records:
        out = RequestOutput(request_id="test_request_id", prompt="test prompt", prompt_token_ids=[1, 2, 3],
                            prompt_logprobs=None, outputs=[], finished=False,
                            example_arg_added_in_new_version="some_value")
        RequestOutput(request_id="again", prompt=None, prompt_token_ids=[1], prompt_logprobs=None, outputs=[],
                      finished=True, example_arg_added_in_new_version="some_value")
    assert out.request_id == "test_request_id" and out.prompt_token_ids == [1, 2, 3] and not out.finished
    assert not hasattr(out, "example_arg_added_in_new_version")
    warned = [r.getMessage() for r in records]
    assert warned == ["RequestOutput: Ignoring extra arguments: {'example_arg_added_in_new_version': 'some_value'}"]
    # vLLM's own named arguments are kept, and survive dataclasses.replace
    full = RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1], prompt_logprobs=None,
                         outputs=[CompletionOutput(index=0, text="x", token_ids=[4], cumulative_logprob=-0.5,
                                                   logprobs=None, finish_reason="stop", stop_reason=None)],
                         finished=True, metrics=None, lora_request=None, encoder_prompt=None,
                         encoder_prompt_token_ids=None, num_cached_tokens=None)
    assert full.num_cached_tokens == 0 and full.outputs[0].finished()
    again = dataclasses.replace(full, finished=False)
    assert again.outputs == full.outputs and again.encoder_prompt is None and not again.finished


# ------------------------------------------------------------------ LLM(...) kwargs


def test_vllm_model_args_that_make_no_difference(folder):
    with captured("polyrunner.llm_args") as records:
        llm = LLM(str(folder), backend="cpu", dtype="float32", max_model_len=64, max_num_seqs=2,
                  trust_remote_code=True, tokenizer_mode="auto", revision=None, tokenizer_revision=None,
                  download_dir=None, disable_log_stats=True, swap_space=8, cpu_offload_gb=0, task="generate",
                  skip_tokenizer_init=False, strict_no_recompile=False)
    assert any("trust_remote_code=True is not needed" in r.getMessage() and r.levelno == logging.INFO
               for r in records)
    out = llm.generate("kato", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("kwargs, error, match", [
    ({"revision": "main"}, ValueError, r"revision='main' is not supported: polyrunner loads the model folder"),
    ({"tokenizer_revision": "v2"}, ValueError, r"tokenizer_revision='v2' is not supported"),
    ({"tokenizer_mode": "slow"}, ValueError, r"tokenizer_mode='slow' is not supported.*accepted: 'auto' or 'hf'"),
    ({"cpu_offload_gb": 4}, ValueError, r"cpu_offload_gb=4 is not supported: polyrunner does not offload"),
    ({"download_dir": "/tmp/x"}, ValueError, r"download_dir='/tmp/x' is not supported"),
    ({"disable_log_stats": False}, ValueError, r"disable_log_stats=False is not supported"),
    ({"swap_space": -1}, ValueError, r"swap_space=-1 is not supported"),
    ({"skip_tokenizer_init": True}, ValueError, r"skip_tokenizer_init=True is not supported"),
    ({"task": "embed"}, ValueError, r"task='embed' is not supported: polyrunner runs generative models only"),
    ({"trust_remote_code": "yes"}, ValueError, r"trust_remote_code must be a bool"),
    ({"no_such_option": 1}, TypeError, r"LLM.__init__\(\) got an unexpected keyword argument 'no_such_option'$"),
    ({"trust_remote_cod": True}, TypeError, r"unexpected keyword argument 'trust_remote_cod' "
                                            r"\(did you mean 'trust_remote_code'\?\)"),
    ({"max_num_seq": 4}, TypeError, r"'max_num_seq' \(did you mean 'max_num_seqs'\?\)"),
])
def test_vllm_model_args_refused_clearly(folder, kwargs, error, match):
    """Refused before the model loads, naming the argument (never a pydantic RunnerConfig error)."""
    with pytest.raises(error, match=match) as info:
        LLM(str(folder), backend="cpu", **kwargs)
    assert "RunnerConfig" not in str(info.value)


def test_embedded_model_template_renders_like_transformers():
    """The embedded SmolLM2's own tokenizer folder (its GGUF conversion), tokenizer only."""
    pytest.importorskip("gguf")
    from polyrunner.engine.tokenizer import Tokenizer
    from polyrunner.models.source import resolve_model_folder

    folder = resolve_model_folder(None)
    mine, ref = Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)
    messages = CHAT + [{"role": "assistant", "content": "Rome"}]
    assert mine.apply_chat_template(messages, False, continue_final_message=True) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert mine.apply_chat_template(CHAT, True, tools=TOOLS) == ref.apply_chat_template(
        CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
