"""The server's structured outputs, driven by the official `openai` client:
`response_format` (json_schema, json_object, text) and vLLM's `structured_outputs`
extra body field, on chat and completions; invalid constraints answered 400
naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from polyrunner.engine.async_llm import AsyncLLM
from polyrunner.tools.serve.api_server import build_app

pytest.importorskip("xgrammar")
pytest.importorskip("gguf")

from test_serve import ServerThread

MODEL = "smol"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population", "tags"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                         "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]},
                                  "minItems": 1, "maxItems": 3}}}


@pytest.fixture(scope="module")
def client():
    allm = AsyncLLM(max_model_len=512, max_num_seqs=8, engine_process=True)
    srv = ServerThread(build_app(allm, served_model_names=[MODEL]))
    yield srv.client()
    srv.stop()
    allm.shutdown(0)


def ask(client, text: str, max_tokens: int = 128, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, temperature=0, **kw)


def test_response_format_json_schema(client):
    r = ask(client, "Describe a city as JSON.",
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_response_format_json_object_and_text(client):
    r = ask(client, "Give a JSON object about a dog.", response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:
        assert c.message.content.lstrip().startswith("{")
    # the prompt in the prefix cache first: both compared requests prefill the same tail (a prompt
    # computed whole and after a cache hit take other kernel paths and may flip a near-tie)
    ask(client, "Say hi.", max_tokens=1)
    plain = ask(client, "Say hi.", max_tokens=8)
    text = ask(client, "Say hi.", max_tokens=8, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_structured_outputs_extra_body(client):
    r = ask(client, "Capital of Italy?", extra_body={"structured_outputs": {"choice": ["Rome", "Milan", "Turin"]}})
    assert r.choices[0].message.content in ("Rome", "Milan", "Turin")
    r = client.completions.create(model=MODEL, prompt="Order number:", max_tokens=16, temperature=0.7, seed=3,
                                  extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{4}"}})
    assert re.fullmatch(r"[A-Z]{2}-\d{4}", r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt="A city:", max_tokens=128, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",   # vLLM accepts it here
                                                                  "json_schema": {"name": "c", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize("kw, field, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}),
     "structured_outputs.json", "response_format"),   # the param names the field the client sent
    (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs.regex", "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}),
     "You can only use one kind of structured outputs constraint", "structured_outputs"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}),
     "at most one of response_format and structured_outputs", "response_format"),
    (dict(response_format={"type": "json_schema"}), "json_schema.schema", "response_format.json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type", "response_format.type"),
])
def test_invalid_constraints_400(client, kw, field, param):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, "hi", **kw)
    assert info.value.status_code == 400
    assert field in info.value.message
    assert info.value.body["param"] == param


def test_streamed_json_schema(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a city as JSON."}], max_tokens=128,
        temperature=0.9, seed=11, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
