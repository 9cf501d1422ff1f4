"""`polyrunner serve`: a real uvicorn server on a loopback port, driven by the
official `openai` client and by httpx — completions and chat, streamed and not,
parity with `LLM.generate`, a bounded load test with disconnecting clients,
bad requests, limits, the API key, metrics and SIGTERM."""

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from polyrunner import LLM, SamplingParams
from polyrunner.engine.async_llm import AsyncLLM
from polyrunner.tools.serve.api_server import build_app
from processes import serve_process

pytest.importorskip("gguf")

MODEL = "smol"
MAX_MODEL_LEN = 512
ENGINE_ARGS = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=32, max_num_batched_tokens=1024)
PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "The quick brown fox",
           "Water boils at", "My favourite colour is"]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 (a free port) in a background thread."""

    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@pytest.fixture(scope="module")
def allm():
    a = AsyncLLM(**ENGINE_ARGS, engine_process=True)   # as `polyrunner serve` runs it
    yield a
    a.shutdown(0)


@pytest.fixture(scope="module")
def srv(allm):
    s = ServerThread(build_app(allm, served_model_names=[MODEL], max_body_bytes=64 << 10))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return srv.client()


@pytest.fixture(scope="module")
def ref_llm():
    return LLM(**ENGINE_ARGS)


def wait_idle(a: AsyncLLM, timeout: float = 20.0) -> None:
    """Wait until no request is left; then nothing may be held (the engine's own
    counts, from its process: requests, KV blocks, runner slots)."""
    deadline = time.monotonic() + timeout
    while (a.num_requests or not a.counts.idle) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert a.num_requests == 0 and a.num_waiting == 0 and a.num_running == 0
    assert a.counts.idle, a.counts


def parse_sse(text: str) -> list:
    """Events of an SSE body; asserts the framing and the final [DONE]."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    assert [e for e in events if e == "data: [DONE]"] == [events[-1]]
    return [json.loads(e[6:]) for e in events[:-1]]


def tokenize(srv, **body) -> list[int]:
    return httpx.post(srv.url + "/tokenize", json=body).json()["tokens"]


# ----------------------------------------------------------------- the API


def test_models_health_tokenize(srv, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == 2 and r["max_model_len"] == MAX_MODEL_LEN and len(r["token_strs"]) == 2
    assert httpx.post(srv.url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    bad = httpx.post(srv.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_completion_plain_and_streamed(srv, client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    full = client.completions.create(**kw, extra_body={"return_token_ids": True})
    choice = full.choices[0]
    assert full.object == "text_completion" and "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == len(choice.token_ids) == 12
    assert full.usage.prompt_tokens == len(tokenize(srv, prompt=kw["prompt"])) == len(choice.prompt_token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in content) == choice.text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert all(c.usage is None for c in content)
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_chat_plain_and_streamed(srv, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert full.usage.prompt_tokens == len(tokenize(srv, messages=messages))
    assert full.usage.completion_tokens <= 10

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = [c for c in chunks[1:] if c.choices]
    assert all(c.choices[0].delta.role is None for c in content)
    assert "".join(c.choices[0].delta.content or "" for c in content) == msg.content
    assert content[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_chat_streams_without_usage_unless_asked(srv):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    events = parse_sse(httpx.post(srv.url + "/v1/chat/completions", json=body).text)
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_n2_seed_and_usage(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kw, extra_body={"return_token_ids": True})
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]   # the same seed, the same text
    assert a.usage.completion_tokens == sum(len(c.token_ids) for c in a.choices)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8,
                temperature=1.0, seed=99)
    x = client.chat.completions.create(**chat, n=2)
    y = client.chat.completions.create(**chat, n=2)
    assert [c.message.content for c in x.choices] == [c.message.content for c in y.choices]
    assert sorted(c.index for c in x.choices) == [0, 1]
    streamed = list(client.chat.completions.create(**chat, n=2, stream=True))
    texts = {0: "", 1: ""}
    for ch in streamed:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in x.choices]
    # several prompts x n=2, streamed: choice index = prompt * n + completion
    multi = dict(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, temperature=1.0, n=2, seed=5)
    plain = client.completions.create(**multi)
    got = {}
    for ch in client.completions.create(**multi, stream=True):
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + c.text
    assert sorted(got) == [0, 1, 2, 3] == [c.index for c in plain.choices]
    assert [got[i] for i in range(4)] == [c.text for c in plain.choices]


def test_stop_strings(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                    temperature=0, stop=["\n"])
    c = out.choices[0]
    assert c.finish_reason == "stop" and "\n" not in c.text and "Paris" in c.text
    assert c.model_extra["stop_reason"] == "\n"


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                    temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and top[tok] == x == max(top.values())   # greedy: the best token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode() == entry.token


def test_greedy_parity_with_llm_generate(srv, client, allm, ref_llm):
    wait_idle(allm)   # an idle engine: the prompts get the same steps as in LLM.generate
    sp = SamplingParams(temperature=0, max_tokens=16)
    expected = ref_llm.generate(PROMPTS, sp, use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in got.choices] == list(range(len(PROMPTS)))
    for c, e in zip(got.choices, expected):
        assert c.token_ids == e.outputs[0].token_ids
        assert c.prompt_token_ids == e.prompt_token_ids
        assert c.text == e.outputs[0].text
    assert got.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)

    # its own system prompt: no block of this prompt is in either prefix cache
    messages = [{"role": "system", "content": "Parity check: answer briefly."},
                {"role": "user", "content": "Name a French city."}]
    wait_idle(allm)
    exp_chat = ref_llm.chat(messages, sp)[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert chat.choices[0].token_ids == exp_chat.outputs[0].token_ids
    assert chat.model_extra["prompt_token_ids"] == exp_chat.prompt_token_ids
    assert chat.choices[0].message.content == exp_chat.outputs[0].text


def test_metrics(srv, client, allm):
    from prometheus_client.parser import text_string_to_metric_families
    client.completions.create(model=MODEL, prompt="Water boils at", max_tokens=5, temperature=0)
    wait_idle(allm)
    text = httpx.get(srv.url + "/metrics").text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[s.name] = samples.get(s.name, 0) + s.value
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert samples[f"polyrunner:{name}"] == 0
    assert samples["polyrunner:engine_healthy"] == 1
    assert samples["polyrunner:prompt_tokens_total"] > 0
    assert samples["polyrunner:generation_tokens_total"] >= 5
    assert "polyrunner:num_preemptions_total" in samples
    assert samples["polyrunner:request_success_total"] >= 1
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert samples[f"polyrunner:{h}_count"] >= 1


# ------------------------------------------------------------ load and robustness


def test_load_with_disconnecting_clients(srv, allm):
    """64 concurrent streaming clients x 4 requests; every 4th client drops its
    streams mid-way. No 5xx, every finished stream well-formed, nothing left."""
    n_clients, per_client = 64, 4
    statuses, finished, dropped = [], [], []

    async def one_client(k: int, client: httpx.AsyncClient) -> None:
        for j in range(per_client):
            drop = k % 4 == 0
            body = {"model": MODEL, "prompt": f"{PROMPTS[(k + j) % len(PROMPTS)]} {k}-{j}", "stream": True,
                    "max_tokens": 40 if drop else 8, "temperature": 0.7, "seed": k * 10 + j}
            if drop:
                body["ignore_eos"] = True
            if j % 2:
                body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
            path = "/v1/chat/completions" if j % 2 else "/v1/completions"
            async with client.stream("POST", srv.url + path, json=body) as r:
                statuses.append(r.status_code)
                if drop:
                    seen = 0
                    async for _ in r.aiter_lines():
                        seen += 1
                        if seen >= 4:
                            break
                    dropped.append(seen)
                    continue
                finished.append((path, await r.aread()))

    async def main():
        limits = httpx.Limits(max_connections=n_clients + 8, max_keepalive_connections=n_clients + 8)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            await asyncio.gather(*(one_client(k, client) for k in range(n_clients)))

    aborted_before = _abort_count(srv)
    t0 = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - t0
    assert len(statuses) == n_clients * per_client and set(statuses) == {200}, sorted(set(statuses))
    assert len(dropped) == n_clients // 4 * per_client
    assert len(finished) == n_clients * per_client - len(dropped)
    for path, raw in finished:
        events = parse_sse(raw.decode())
        content = [e for e in events if e["choices"]]
        kind = "chat.completion.chunk" if "chat" in path else "text_completion"
        assert all(e["object"] == kind and e["id"] == events[0]["id"] for e in events)
        assert content[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert all(e["choices"][0]["finish_reason"] is None for e in content[:-1])
    wait_idle(allm)
    assert elapsed < 90
    # the dropped streams were aborted by their disconnect (not run to their 40 tokens)
    assert _abort_count(srv) - aborted_before >= len(dropped) // 2


def _abort_count(srv) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for s in fam.samples:
            if s.name == "polyrunner:request_success_total" and s.labels.get("finished_reason") == "abort":
                return s.value
    return 0.0


def _error(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


def test_bad_requests_get_4xx_while_a_stream_carries_on(srv, allm):
    url = srv.url + "/v1/completions"
    long_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True,
                 "stream": True, "temperature": 0}
    result = {}

    def stream() -> None:
        with httpx.stream("POST", url, json=long_body, timeout=60) as r:
            result["status"] = r.status_code
            result["body"] = r.read().decode()

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 20
    while not allm.num_running and time.monotonic() < deadline:
        time.sleep(0.005)

    def post(body, path="/v1/completions", **kw):
        return httpx.post(srv.url + path, json=body, **kw)

    ok = {"model": MODEL, "prompt": "Hello"}
    _error(httpx.post(url, content=b'{"prompt": "x",', headers={"content-type": "application/json"}),
           400, None, "JSON")
    _error(post({**ok, "max_tokens": "ten"}), 400, "max_tokens", "integer")
    _error(post({**ok, "temperature": "hot"}), 400, "temperature")
    _error(post({**ok, "prompt": [1.5]}), 400, "prompt")
    _error(post({**ok, "stream": "yes"}), 400, "stream")
    err = _error(post({**ok, "model": "gpt-x"}), 404, "model", "The model `gpt-x` does not exist.")
    assert err["code"] == "model_not_found"
    _error(post({**ok, "max_tokens": 0}), 400, "max_tokens", "max_tokens")
    _error(post({**ok, "temperature": -0.5}), 400, "temperature", "temperature")
    err = _error(post({**ok, "prompt": "hello " * 600}), 400, "prompt", str(MAX_MODEL_LEN))
    assert err["code"] == "context_length_exceeded"
    _error(post({**ok, "max_tokenz": 5}), 400, "max_tokenz", "Unrecognized request argument")
    _error(post({"model": MODEL}), 400, "prompt", "Missing")
    _error(post({**ok, "prompt": ""}), 400, "prompt")
    _error(post({**ok, "logit_bias": {"abc": 1}}), 400, "logit_bias")
    _error(post({**ok, "top_p": 0}), 400, "top_p")
    _error(post({**ok, "stop_token_ids": [10**7]}), 400, "stop_token_ids", "vocabulary")   # the engine's check
    _error(post({**ok, "prompt": [10**7, 1]}), 400, "prompt", "vocabulary")
    _error(post({**ok, "logprobs": 100}), 400, "logprobs", "20")            # the engine's max_logprobs
    _error(post({**ok, "n": 1000}), 400, "n")                               # the engine's cap on n
    _error(post([1, 2]), 400, None, "object")
    chat = "/v1/chat/completions"
    _error(post({"model": MODEL, "messages": []}, chat), 400, "messages")
    _error(post({"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}, chat), 400, "messages[0].role")
    _error(post({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, chat), 400, "messages[0].content")
    _error(post({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
                chat), 400, "max_completion_tokens")
    _error(post({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, chat),
           400, "top_logprobs")
    _error(post({**ok, "prompt": "x" * (70 << 10)}), 413, None, "limit")
    _error(httpx.get(srv.url + "/v1/nothing"), 404, None)
    # and the official client sees them as its typed errors
    client = srv.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"

    t.join(60)
    assert result["status"] == 200
    events = parse_sse(result["body"])
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in events if e["choices"]) >= 2
    assert allm.is_healthy and httpx.get(srv.url + "/health").status_code == 200
    wait_idle(allm)


def test_api_key(allm):
    s = ServerThread(build_app(allm, served_model_names=[MODEL], api_key="sekret"))
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.get(s.url + "/v1/models", headers=headers)
            _error(r, 401, None, "API key")
        _error(httpx.post(s.url + "/v1/completions", json={"prompt": "x"}), 401, None)
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        out = s.client(api_key="sekret").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert out.usage.completion_tokens == 2
    finally:
        s.stop()


# ------------------------------------------- waiting cap, disconnects, a dead engine


@pytest.fixture()
def slow_tiny(tiny_model_factory):
    """A tiny model served with one slot and a slow step (requests queue up)."""
    folder, _ = tiny_model_factory("llama")
    a = AsyncLLM(str(folder), backend="cpu", dtype="float32", max_num_seqs=1)
    step = a.engine.step
    a.engine.step = lambda: (time.sleep(0.01), step())[1]
    yield a
    a.shutdown(0)


def _ids_body(max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": [1, 5, 9, 13], "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def test_waiting_cap_answers_503_with_retry_after(slow_tiny):
    s = ServerThread(build_app(slow_tiny, max_waiting=1, retry_after_s=2))
    threads = []
    try:
        def bg():
            httpx.post(s.url + "/v1/completions", json=_ids_body(60), timeout=60)

        for _ in range(2):   # one runs, one waits
            threads.append(threading.Thread(target=bg))
            threads[-1].start()
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while slow_tiny.num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = httpx.post(s.url + "/v1/completions", json=_ids_body(4))
        err = _error(r, 503, None, "busy")
        assert r.headers["retry-after"] == "2" and err["code"] == "server_busy"
        for t in threads:
            t.join(60)
        ok = httpx.post(s.url + "/v1/completions", json=_ids_body(4))   # room again
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert ok.json()["choices"][0]["text"] == ""   # no tokenizer: token ids only
        text = httpx.post(s.url + "/v1/completions", json={"prompt": "text"})
        _error(text, 400, "prompt", "tokenizer")
    finally:
        s.stop()


def test_client_disconnect_aborts_a_plain_request(slow_tiny):
    s = ServerThread(build_app(slow_tiny))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json=_ids_body(400), timeout=0.5)
        # 400 steps take >= 4 s; the abort frees everything long before
        wait_idle(slow_tiny, timeout=2.0)
        with httpx.stream("POST", s.url + "/v1/completions", json=_ids_body(400, stream=True)) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        wait_idle(slow_tiny, timeout=2.0)
    finally:
        s.stop()


def test_dead_engine_fails_streams_and_health(slow_tiny):
    s = ServerThread(build_app(slow_tiny))
    try:
        step = slow_tiny.engine.step
        calls = []

        def failing():
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("injected device failure")
            return step()

        slow_tiny.engine.step = failing
        r = httpx.post(s.url + "/v1/completions", json=_ids_body(100, stream=True), timeout=20)
        events = r.text.split("\n\n")
        assert r.status_code == 200 and events[-2] == "data: [DONE]"
        err = json.loads(events[-3][6:])["error"]
        assert "injected device failure" in err["message"] and err["type"] == "server_error"
        health = httpx.get(s.url + "/health")
        _error(health, 503, None, "injected device failure")
        _error(httpx.post(s.url + "/v1/completions", json=_ids_body(4)), 503, None, "engine loop died")
    finally:
        s.stop()


# ------------------------------------------------------------------- the command


def test_sigterm_finishes_the_request_in_flight_and_exits_0():
    with serve_process("--max-model-len", "256", "--max-num-seqs", "4", "--served-model-name", MODEL,
                       "--shutdown-timeout", "30", "--log-level", "warning") as (proc, url):
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = "".join(line + "\n" for line in lines)
        assert rest.rstrip().endswith("data: [DONE]")
        events = [json.loads(x[6:]) for x in rest.split("\n") if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0, proc.stdout.read()
