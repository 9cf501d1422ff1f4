"""`polyrunner serve` against cheap requests meant to stall other clients: huge
invalid bodies (a short error, fast), huge prompts (tokenized off the event
loop), many prompts in one request (admission counts sequences; a cap on
prompts), non-JSON bodies (415), bad or too-deep schemas (400 naming the field
sent), a dead engine's gauges, and streams cut by the shutdown timeout."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from polyrunner.tools.serve.api_server import build_app
from processes import serve_process

pytest.importorskip("gguf")

from test_serve import MODEL, ServerThread, _error, _ids_body, allm, parse_sse, slow_tiny, wait_idle  # noqa: F401 - fixtures reused: allm (smol, engine process), slow_tiny

FOUR_MB = 4 << 20


@pytest.fixture(scope="module")
def srv(allm):
    """The default limits (4 MiB bodies, 256 prompts) and a waiting cap of 2 sequences."""
    s = ServerThread(build_app(allm, served_model_names=[MODEL], max_waiting=2))
    yield s
    s.stop()


def _post(srv, body, path: str = "/v1/completions", **kw) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


# ------------------------------------------------------------- 1. huge invalid bodies


def test_huge_invalid_body_gets_a_short_error_fast(srv):
    body = json.dumps({"model": MODEL, "prompt": [0.5] * 600_000}).encode()
    assert len(body) >= 3_000_000
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    elapsed = time.monotonic() - t0
    err = _error(r, 400, "prompt", "Invalid value")
    assert len(r.content) < 64 << 10 and elapsed < 1.0, (len(r.content), elapsed)
    assert "..." in err["message"]   # the value it got, cut short


@pytest.mark.parametrize("body, path, param", [
    ({"prompt": [[1, 0.5]] * 400_000}, "/v1/completions", "prompt"),                   # nested lists
    ({"prompt": "x", **{f"k{i}": 1 for i in range(250_000)}}, "/v1/completions", "k0"),   # unknown fields
    ({"prompt": "x", "logit_bias": {str(i): "a" for i in range(250_000)}}, "/v1/completions", "logit_bias.0"),
    ({"prompt": "x", "stop": [5] * 800_000}, "/v1/completions", "stop"),
    ({"messages": [{"role": "bot", "content": "x"}] * 100_000}, "/v1/chat/completions", "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}] * 200_000}]}, "/v1/chat/completions",
     "messages[0].content"),
    ({"tokens": ["a"] * 800_000}, "/detokenize", "tokens[0]"),
])
def test_every_huge_invalid_shape_is_one_short_error(srv, body, path, param):
    raw = json.dumps({"model": MODEL, **body}).encode()
    assert len(raw) <= FOUR_MB
    t0 = time.monotonic()
    r = httpx.post(srv.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    elapsed = time.monotonic() - t0
    err = _error(r, 400, param)
    assert len(r.content) < 4 << 10 and err["message"].count(";") < 6, err
    assert elapsed < 3.0, elapsed


# ------------------------------------------------------------- 2. tokenization off the loop


def test_health_answers_while_a_huge_prompt_tokenizes(srv):
    prompt = "hello world, this is a test. " * (FOUR_MB // 29 - 8)
    result = {}

    def big() -> None:
        result["response"] = _post(srv, {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        result["done"] = time.monotonic()

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.3)
    latencies, polled = [], []
    while t.is_alive() and len(latencies) < 40:
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
        latencies.append(time.monotonic() - t0)
        polled.append(t0)
        time.sleep(0.05)
    t.join(60)
    err = _error(result["response"], 400, "prompt", "maximum context length")
    assert err["code"] == "context_length_exceeded"
    during = [lat for lat, at in zip(latencies, polled) if at < result["done"]]
    assert during, "the prompt was answered before /health was asked: nothing measured"
    assert max(during) < 0.5, latencies


# ------------------------------------------------------------- 3. admission counts sequences


def test_waiting_cap_counts_sequences_and_prompts_are_capped(srv, allm):
    wait_idle(allm)
    many = {"model": MODEL, "prompt": [[1, 5, 9]] * 30, "max_tokens": 1}
    r = _post(srv, many)
    err = _error(r, 503, None, "30", "limit 2")
    assert err["code"] == "server_busy" and r.headers["retry-after"] == "1"
    _error(_post(srv, {"model": MODEL, "prompt": [1, 5, 9], "max_tokens": 1, "n": 3}), 503, None, "adds 3")
    ok = _post(srv, {"model": MODEL, "prompt": [[1, 5, 9]] * 2, "max_tokens": 1})   # exactly the cap
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    err = _error(_post(srv, {"model": MODEL, "prompt": [[1, 5, 9]] * 257, "max_tokens": 1}), 400, "prompt",
                 "257", "256")
    assert err["code"] == "too_many_prompts"
    wait_idle(allm)


# ------------------------------------------------------------- 4. JSON bodies only


def test_non_json_bodies_get_415(srv, allm):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    url = srv.url + "/v1/completions"
    for headers in ({"content-type": "text/plain"}, {"content-type": "text/plain;charset=UTF-8"},
                    {"content-type": "multipart/form-data; boundary=x"}, {}):
        err = _error(httpx.post(url, content=body, headers=headers), 415, None, "application/json")
        assert err["code"] == "unsupported_media_type"
    _error(httpx.post(url, data={"model": MODEL, "prompt": "Hi"}), 415, None)       # a form
    _error(httpx.post(srv.url + "/tokenize", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}),
           415, None)
    for ctype in ("application/json; charset=utf-8", "application/merge-patch+json"):
        assert httpx.post(url, content=body, headers={"content-type": ctype}).status_code == 200
    wait_idle(allm)


# ------------------------------------------------------------- 5. schemas: 400, naming the field sent


def _deep_schema_text(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def test_schema_errors_are_400_naming_the_field_sent(srv):
    pytest.importorskip("xgrammar")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}
    _error(_post(srv, {**chat, "response_format": schema}, "/v1/chat/completions"), 400, "response_format")
    _error(_post(srv, {"model": MODEL, "prompt": "x", "max_tokens": 1, "response_format": schema}), 400,
           "response_format")
    deep = {"structured_outputs": {"json": _deep_schema_text(900)}}
    _error(_post(srv, {**chat, **deep}, "/v1/chat/completions"), 400, "structured_outputs", "recursion")
    _error(_post(srv, {**chat, "structured_outputs": {"grammar": "root ::= ("}}, "/v1/chat/completions"),
           400, "structured_outputs")
    too_deep = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(_deep_schema_text(150))}}
    err = _error(_post(srv, {**chat, "response_format": too_deep}, "/v1/chat/completions"), 400, None)
    assert err["code"] == "invalid_json"   # the body itself nests too deeply (200 levels at most)
    deep_dict = json.loads(_deep_schema_text(90))
    for odd in ({"type": "object", "properties": 5}, {"$ref": "#/nope"}, {"type": ["string", 5]}, deep_dict):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": odd}}
        r = _post(srv, {**chat, "response_format": fmt}, "/v1/chat/completions")
        assert r.status_code in (200, 400), (odd, r.status_code, r.text[:300])
        if r.status_code == 400:
            assert r.json()["error"]["param"] == "response_format", r.text[:300]


# ------------------------------------------------------------- 6. a dead engine's gauges


def _gauges(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {s.name: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in fam.samples if s.name.startswith("polyrunner:") and not s.name.endswith(("_total", "_created"))}


def test_gauges_drop_to_zero_when_the_engine_dies(slow_tiny):
    s = ServerThread(build_app(slow_tiny))
    threads = []
    try:
        for _ in range(3):   # one slot: one runs, two wait
            threads.append(threading.Thread(
                target=lambda: httpx.post(s.url + "/v1/completions", json=_ids_body(400, stream=True), timeout=30)))
            threads[-1].start()
        deadline = time.monotonic() + 10
        while not (slow_tiny.num_running == 1 and slow_tiny.num_waiting == 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        g = _gauges(s.url)
        assert g["polyrunner:num_requests_running"] == 1 and g["polyrunner:num_requests_waiting"] == 2, g
        assert g["polyrunner:engine_healthy"] == 1 and g["polyrunner:kv_cache_usage_perc"] > 0

        def failing():
            raise RuntimeError("injected device failure")

        slow_tiny.engine.step = failing
        deadline = time.monotonic() + 10
        while slow_tiny.is_healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        g = _gauges(s.url)
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "engine_healthy"):
            assert g[f"polyrunner:{name}"] == 0, (name, g)
        for t in threads:
            t.join(30)
    finally:
        s.stop()


# ------------------------------------------------------------- 7. the shutdown timeout


def test_shutdown_timeout_ends_open_calls_with_an_error_and_a_clean_log():
    with serve_process("--max-model-len", "2048", "--max-num-seqs", "4", "--served-model-name", MODEL,
                       "--shutdown-timeout", "1", "--log-level", "info") as (proc, url):
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        plain = {}

        def non_streamed() -> None:
            plain["response"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

        t = threading.Thread(target=non_streamed)
        t.start()
        deadline = time.monotonic() + 20
        while _gauges(url)["polyrunner:num_requests_running"] < 1:   # admitted
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = "".join(line + "\n\n" for line in lines if line)
        took = time.monotonic() - t0
        events = parse_sse(first + "\n\n" + rest)
        err = events[-1]["error"]
        assert err["code"] == "shutting_down" and err["type"] == "server_error" and "1 s" in err["message"]
        assert all("choices" in e for e in events[:-1]) and 0.9 < took < 5.0, took
        t.join(30)
        _error(plain["response"], 503, None, "shutting down")
        assert proc.wait(30) == 0
        log = proc.stdout.read()
        for bad in ("Traceback", "CancelledError", "Exception in ASGI application", "graceful shutdown exceeded"):
            assert bad not in log, log
