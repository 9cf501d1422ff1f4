"""Multi-LoRA served (vLLM's endpoints and flags), through the official `openai` client: adapters
from `--lora-modules` served as models, the same greedy tokens as `LLM.generate(...,
lora_request=...)` offline (completions and chat, plain and streamed), `/v1/models` listing
them, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` behind the API key, errors for
unknown names and bad adapters while the engine keeps serving; and `AsyncLLM`'s adapter calls
on an engine thread."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import httpx
import openai
import pytest

from lora_adapters import ATTENTION, MLP, make_peft_adapter
from polyrunner import LLM, SamplingParams
from polyrunner.engine.async_llm import AsyncLLM
from polyrunner.lora.request import LoRARequest
from polyrunner.tools.cli import main
from polyrunner.tools.serve.api_server import build_app
from polyrunner.tools.serve.lora import LoRAModulePath, parse_lora_module
from processes import serve_process
from test_serve import ServerThread, wait_idle

BASE = "tiny"
KEY = "sekret"
PROMPT = [1, 5, 9, 13, 17, 21]
MAX_TOKENS = 10
TEMPLATE = "{% for m in messages %}[ {{ m.content }} ]{% endfor %}"
CHAT = [{"role": "user", "content": "hi t7 t9"}]
ENGINE = dict(backend="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128)


def _word_tokenizer(folder, vocab_size: int):
    """A word-level tokenizer.json: '[', ']', 'hi', then t3.. (chat prompts of known ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[": 0, "]": 1, "hi": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    """(model folder, tokenizer folder, adapters: name -> path, with a rank-32 one the engine refuses)."""
    folder, hf = tiny_model_factory("llama")
    tok = _word_tokenizer(tmp_path_factory.mktemp("tok") / "tok", hf.config.vocab_size)
    adapters = {"sql": make_peft_adapter(hf, tmp_path_factory.mktemp("sql"), 8, ATTENTION, seed=1),
                "chat": make_peft_adapter(hf, tmp_path_factory.mktemp("chat"), 4, MLP, seed=2),
                "wide": make_peft_adapter(hf, tmp_path_factory.mktemp("wide"), 32, ATTENTION, seed=3)}
    return str(folder), str(tok), adapters


@pytest.fixture(scope="module")
def offline(setup):
    """adapter name (None: the base model) -> (greedy completion ids of PROMPT, of the chat prompt)."""
    folder, tok, adapters = setup
    llm = LLM(folder, tokenizer=tok, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chat_ids = [0, 2, 7, 9, 1]   # CHAT rendered by TEMPLATE, in the word tokenizer's ids
    out = {}
    for i, name in enumerate([None, "sql", "chat"]):
        lora = None if name is None else LoRARequest(name, 100 + i, adapters[name])   # any id: ids are per engine
        runs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": chat_ids}], params,
                            use_tqdm=False, lora_request=lora)
        out[name] = tuple(list(r.outputs[0].token_ids) for r in runs)
    assert out["sql"] != out[None] and out["chat"] != out[None] and out["sql"] != out["chat"], \
        "an adapter that changes nothing proves nothing"
    return out


@pytest.fixture(scope="module")
def allm(setup):
    folder, tok, _ = setup
    a = AsyncLLM(folder, tokenizer=tok, engine_process=True, **ENGINE)   # as `polyrunner serve` runs it
    yield a
    a.shutdown(0)


@pytest.fixture(scope="module")
def srv(setup, allm):
    _, _, adapters = setup
    app = build_app(allm, served_model_names=[BASE], api_key=KEY, chat_template=TEMPLATE,
                    lora_modules=[LoRAModulePath("sql", adapters["sql"])])
    s = ServerThread(app)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return srv.client(api_key=KEY)


def _complete(client, model: str, stream: bool = False) -> list[int]:
    kw = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    if not stream:
        return client.completions.create(**kw).choices[0].token_ids
    return [t for chunk in client.completions.create(**kw, stream=True) for c in chunk.choices
            for t in c.token_ids or []]


def _chat(client, model: str, stream: bool = False) -> list[int]:
    kw = dict(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    if not stream:
        return client.chat.completions.create(**kw).choices[0].token_ids
    return [t for chunk in client.chat.completions.create(**kw, stream=True) for c in chunk.choices
            for t in getattr(c, "token_ids", None) or []]


def _post(client, path: str, body: dict) -> str:
    """POST through the openai client (vLLM's adapter endpoints answer plain text)."""
    return client.post(path, body=body, cast_to=httpx.Response).text


# ------------------------------------------------------------------------------ serving


def test_lora_modules_adapter_as_model_matches_offline(srv, client, offline):
    for stream in (False, True):
        assert _complete(client, "sql", stream) == offline["sql"][0]
        assert _complete(client, BASE, stream) == offline[None][0]
        assert _chat(client, "sql", stream) == offline["sql"][1]
        assert _chat(client, BASE, stream) == offline[None][1]
    out = client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    assert out.model == "sql"


def test_models_list_base_and_adapters(srv, client, setup):
    _, _, adapters = setup
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [BASE, "sql"]
    assert cards["sql"].root == adapters["sql"] and cards["sql"].parent == BASE
    assert cards[BASE].parent is None and cards[BASE].max_model_len == 128


def test_load_serve_unload(srv, client, allm, setup, offline):
    _, _, adapters = setup
    ok = _post(client, "/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]})
    assert ok == "Success: LoRA adapter 'chat' added successfully."
    assert asyncio.run(allm.list_loras()) == {1, 2}   # ids the server gave: 1 (--lora-modules), 2
    with pytest.raises(openai.BadRequestError, match="The lora adapter 'chat' has already been loaded."):
        _post(client, "/load_lora_adapter", {"lora_name": "chat", "lora_path": adapters["chat"]})
    assert [m.id for m in client.models.list().data] == [BASE, "sql", "chat"]
    assert _complete(client, "chat") == offline["chat"][0]
    assert _chat(client, "chat", stream=True) == offline["chat"][1]
    assert _complete(client, "sql") == offline["sql"][0]   # still its own adapter

    ok = _post(client, "/unload_lora_adapter", {"lora_name": "chat"})
    assert ok == "Success: LoRA adapter 'chat' removed successfully."
    assert asyncio.run(allm.list_loras()) == {1}
    assert [m.id for m in client.models.list().data] == [BASE, "sql"]
    with pytest.raises(openai.NotFoundError, match="The model `chat` does not exist."):
        _complete(client, "chat")
    with pytest.raises(openai.NotFoundError, match="The lora adapter 'chat' cannot be found."):
        _post(client, "/unload_lora_adapter", {"lora_name": "chat"})
    # the engine keeps serving; a name loaded again gets a new id
    assert _complete(client, BASE) == offline[None][0]
    _post(client, "/load_lora_adapter", {"lora_name": "chat2", "lora_path": adapters["chat"]})
    assert asyncio.run(allm.list_loras()) == {1, 3}
    assert _complete(client, "chat2") == offline["chat"][0]
    _post(client, "/unload_lora_adapter", {"lora_name": "chat2"})
    wait_idle(allm)


def test_unknown_adapter_and_bad_loads(srv, client, allm, setup, tmp_path):
    _, _, adapters = setup
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist.") as e:
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["param"] == "model"

    def bad_load(body: dict, *words: str) -> None:
        with pytest.raises(openai.BadRequestError) as e:
            _post(client, "/load_lora_adapter", body)
        assert all(w in e.value.body["message"] for w in words), e.value.body

    bad_load({"lora_name": "wide", "lora_path": adapters["wide"]}, "LoRA rank 32 is greater than max_lora_rank 16")
    bad_load({"lora_name": "gone", "lora_path": str(tmp_path / "missing")}, "Loading lora adapter 'gone' failed",
             "missing")
    bad_load({"lora_name": "", "lora_path": adapters["chat"]}, "Both 'lora_name' and 'lora_path' must be provided.")
    bad_load({"lora_name": BASE, "lora_path": adapters["chat"]}, "served base model")
    bad_load({"lora_name": "x"}, "lora_path")   # the body's field is missing
    assert [m.id for m in client.models.list().data] == [BASE, "sql"]
    assert asyncio.run(allm.list_loras()) == {1}
    assert len(_complete(client, "sql")) == MAX_TOKENS
    wait_idle(allm)


def test_adapter_endpoints_need_the_api_key(srv, setup):
    _, _, adapters = setup
    body = {"lora_name": "chat", "lora_path": adapters["chat"]}
    for path in ("/load_lora_adapter", "/unload_lora_adapter"):
        with pytest.raises(openai.AuthenticationError):
            _post(srv.client(api_key="wrong"), path, body)
        r = httpx.post(srv.url + "/v1" + path, json=body)   # no key at all
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert [m.id for m in srv.client(api_key=KEY).models.list().data] == [BASE, "sql"]


# -------------------------------------------------------------------- AsyncLLM, engine thread


def test_engine_process_outputs_carry_the_adapter(allm, setup, offline):
    _, _, adapters = setup
    sql = LoRARequest("sql", 1, adapters["sql"])   # the id the server gave it
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run():
        return [out async for out in allm.generate({"prompt_token_ids": PROMPT}, params, lora_request=sql)]

    outs = asyncio.run(run())
    assert list(outs[-1].outputs[0].token_ids) == offline["sql"][0]
    assert all(out.lora_request == sql for out in outs)
    wait_idle(allm)


def test_async_llm_adapter_calls_on_an_engine_thread(setup, offline):
    folder, tok, adapters = setup
    a = AsyncLLM(folder, tokenizer=tok, engine_process=False, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run(lora):
        last = None
        async for out in a.generate({"prompt_token_ids": PROMPT}, params, lora_request=lora):
            last = out
        return list(last.outputs[0].token_ids), last.lora_request

    async def main_():
        sql = LoRARequest("sql", 7, adapters["sql"])
        assert await a.add_lora(sql) is True
        assert await a.list_loras() == {7}
        with pytest.raises(ValueError, match="LoRA rank 32 is greater than max_lora_rank 16"):
            await a.add_lora(LoRARequest("wide", 8, adapters["wide"]))
        assert await a.list_loras() == {7}
        assert await run(sql) == (offline["sql"][0], sql)
        assert (await run(None))[0] == offline[None][0]
        assert await a.remove_lora(7) is True
        assert await a.remove_lora(7) is False
        assert await a.list_loras() == set()

    try:
        asyncio.run(main_())
    finally:
        a.shutdown(0)


# ------------------------------------------------------------------------------ the command


def test_parse_lora_modules():
    assert parse_lora_module("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("x", "/p", "m")
    with pytest.raises(ValueError, match="Invalid JSON format for --lora-modules"):
        parse_lora_module("{nope")
    with pytest.raises(ValueError, match="Invalid fields for --lora-modules"):
        parse_lora_module('{"name": "x", "where": "/p"}')


def test_lora_modules_without_enable_lora_is_an_error(capsys):
    assert main(["serve", "--lora-modules", "sql=/nowhere"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err


def test_serve_command_with_lora_modules(setup, offline):
    folder, tok, adapters = setup
    chat = json.dumps({"name": "chat", "path": adapters["chat"], "base_model_name": BASE})
    with serve_process(folder, "--backend", "cpu", "--tokenizer", tok, "--dtype", "float32", "--max-model-len", "128",
                       "--served-model-name", BASE, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                       "--lora-modules", f"sql={adapters['sql']}", chat, "--api-key", KEY,
                       "--log-level", "warning") as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == [BASE, "sql", "chat"]
        assert _complete(client, "chat") == offline["chat"][0]
        assert _complete(client, "sql", stream=True) == offline["sql"][0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_serve_command_fails_on_a_bad_lora_module(setup):
    folder, tok, adapters = setup
    run = subprocess.run([sys.executable, "-m", "polyrunner", "serve", folder, "--backend", "cpu", "--dtype", "float32",
                          "--max-model-len", "128", "--enable-lora", "--lora-modules", f"wide={adapters['wide']}",
                          "--log-level", "warning"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "--lora-modules wide=" in run.stderr and "LoRA rank 32 is greater than max_lora_rank 16" in run.stderr
