"""Structured outputs on the embedded model (SmolLM2-135M, CPU): 50 generated JSON
schemas (nested objects, arrays, enums, bounded numbers, required fields), greedy
and sampled, every output parsing and validating with `jsonschema`; regex outputs
fullmatch; choice outputs are among the choices; an EBNF grammar's outputs parse;
synchronous and asynchronous scheduling; invalid constraints refused before
scheduling, naming the field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from polyrunner import LLM, SamplingParams
from polyrunner.plugins import hookimpl, register
from polyrunner.plugins.manager import unregister
from polyrunner.sampling_params import SamplingParamsError, StructuredOutputsParams

pytest.importorskip("xgrammar")
pytest.importorskip("gguf")

from test_async_scheduling import DeferredCopyCPU, DeferredCopyPaddedCPU

NUM_SCHEMAS = 50
MAX_TOKENS = 128


def make_schema(i: int) -> dict:
    """A deterministic, bounded schema (so a complete output fits in MAX_TOKENS tokens)."""
    rng = random.Random(1000 + i)
    words = ["red", "green", "blue", "cat", "dog", "fish", "north", "south", "alpha", "beta"]

    def leaf(depth: int) -> dict:
        kind = rng.choice(["int", "num", "enum", "str", "bool", "arr"] + (["obj"] if depth < 2 else []))
        if kind == "int":
            lo = rng.randint(-50, 50)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
        if kind == "num":
            lo = rng.randint(0, 10)
            return {"type": "number", "minimum": lo, "maximum": lo + 10}
        if kind == "enum":
            return {"enum": rng.sample(words, rng.randint(2, 4))}
        if kind == "str":
            return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
        if kind == "bool":
            return {"type": "boolean"}
        if kind == "arr":
            item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9},
                               {"enum": rng.sample(words, 3)}])
            return {"type": "array", "items": item, "minItems": 1, "maxItems": rng.randint(1, 3)}
        return obj(depth + 1, rng.randint(1, 2))

    def obj(depth: int, n: int) -> dict:
        names = rng.sample(["id", "name", "size", "color", "kind", "score", "items", "meta", "ok", "level"], n)
        props = {name: leaf(depth) for name in names}
        return {"type": "object", "properties": props, "required": names, "additionalProperties": False}

    return obj(0, rng.randint(1, 3))


SCHEMAS = [make_schema(i) for i in range(NUM_SCHEMAS)]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, max_num_seqs=NUM_SCHEMAS, max_num_batched_tokens=4096)


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}],
                                                   add_generation_prompt=True, tokenize=False)


def test_schemas_are_varied():
    text = json.dumps(SCHEMAS)
    for feature in ('"enum"', '"minimum"', '"maxItems"', '"required"', '"number"', '"boolean"'):
        assert feature in text
    assert sum('"properties": {' in json.dumps(s)[1:] for s in SCHEMAS) > 10   # nested objects
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_fifty_json_schemas_validate(llm, mode):
    prompts = [chat(llm, f"Answer with a JSON object with the fields {', '.join(s['properties'])}.") for s in SCHEMAS]
    params = [SamplingParams(temperature=0.0 if mode == "greedy" else 0.8, seed=None if mode == "greedy" else i,
                             max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=s))
              for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text, schema)
        value = json.loads(c.text)
        jsonschema.validate(value, schema)


def test_regex_choice_grammar(llm):
    regexes = [r"\d{3}-[a-z]{2,4}", r"(yes|no), because [a-z ]{5,20}\.", r"[A-Z][a-z]{1,10} [0-9]{1,2}"]
    choices = [["Paris", "London", "Rome"], ["positive", "negative", "neutral"]]
    grammar = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num)*\nnum ::= [1-9] [0-9]?'
    specs = ([StructuredOutputsParams(regex=r) for r in regexes] + [StructuredOutputsParams(choice=c) for c in choices]
             + [StructuredOutputsParams(grammar=grammar)])
    prompts = [chat(llm, q) for q in ["Give a code.", "Is it true?", "Name and age?", "Capital of France?",
                                      "How do you feel?", "Write a sum."]]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=7, max_tokens=48, structured_outputs=s) for s in specs]
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        for r, c in zip(regexes, outs):
            assert c.finish_reason == "stop" and re.fullmatch(r, c.text), (r, c.text)
        for ch, c in zip(choices, outs[3:]):
            assert c.text in ch
        c = outs[5]
        assert c.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)", c.text), c.text
        value = eval(c.text, {"__builtins__": {}})   # the grammar's language is arithmetic
        assert isinstance(value, int)


def test_json_object_and_mixed_batch(llm):
    """Constrained and free rows in one batch: the free row is untouched (the same text as beside the
    same prompt unconstrained). Both batches take the same steps, so that only the constraint
    differs: the prompts are in the prefix cache first (a hit prefills a shorter tail, which may
    round differently), and the other row runs at least as long as the free one."""
    free = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [chat(llm, "Tell me a joke."), chat(llm, "Give a JSON object about a cat.")]
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    beside_free = llm.generate(prompts, [free, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)],
                               use_tqdm=False)[0].outputs[0].text
    outs = llm.generate(prompts, [free, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                       structured_outputs=StructuredOutputsParams(json_object=True))],
                        use_tqdm=False)
    assert len(outs[1].outputs[0].token_ids) >= 24   # so both batches shared their steps
    assert outs[0].outputs[0].text == beside_free
    c = outs[1].outputs[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.text), dict)
    else:   # a long object cut by max_tokens is still a JSON prefix
        assert c.text.lstrip().startswith("{")


class _DeferredCopyPlugin:
    PLUGIN_API_VERSION = "1.0"
    @hookimpl
    def polyrunner_backends(self):
        return [StructuredDeferredCopyCPU, StructuredDeferredCopyPaddedCPU]


class StructuredDeferredCopyCPU(DeferredCopyCPU):
    name = "cpu-deferred-copy-structured"


class StructuredDeferredCopyPaddedCPU(DeferredCopyPaddedCPU):
    name = "cpu-deferred-copy-padded-structured"


@pytest.fixture(scope="module")
def deferred_backends():
    register(_DeferredCopyPlugin(), name="test-structured-async")
    yield
    unregister("test-structured-async")


@pytest.mark.parametrize("backend", [StructuredDeferredCopyCPU.name, StructuredDeferredCopyPaddedCPU.name])
def test_async_scheduling_and_n(deferred_backends, backend):
    """Asynchronous scheduling (tokens reach the host one step late; the grammar catches
    up before each mask), padded static shapes, and n > 1 children sharing one grammar."""
    a = LLM(backend=backend, max_model_len=512, max_num_seqs=8, async_scheduling=True)
    schema = SCHEMAS[3]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=schema))
    for c in a.generate([chat(a, "JSON please.")], params, use_tqdm=False)[0].outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "object", "properties": 3}), "structured_outputs.json"),
    (dict(json='{"type": "objec"}'), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(grammar='root ::= "a" |'), "structured_outputs.grammar"),
])
def test_invalid_constraint_refused_before_scheduling(llm, spec, field):
    engine = llm.engine
    before = engine.scheduler.num_unfinished
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.add_request("hi", SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert engine.scheduler.num_unfinished == before


def test_params_errors_vllm_wording():
    with pytest.raises(SamplingParamsError, match="You can only use one kind of structured outputs constraint"):
        SamplingParams(structured_outputs=dict(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="You can only use one kind of structured outputs constraint"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="You must use one kind of structured outputs constraint"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match=r"structured_outputs\.json"):
        StructuredOutputsParams(json="{not json")
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs.choice == ["a", "b"] and "structured_outputs" in p.features()


def test_preemption_keeps_grammar_state():
    """With a KV cache too small for the batch, requests are preempted and recomputed;
    their slot keeps its matcher, and every output still validates."""
    small = LLM(max_model_len=512, max_num_seqs=8, num_gpu_blocks_override=16, enable_prefix_caching=False)
    schemas = SCHEMAS[:8]
    prompts = [chat(small, f"Answer with a JSON object with the fields {', '.join(s['properties'])}.")
               for s in schemas]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=s))
              for s in schemas]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_with_speculative_decoding():
    """n-gram speculation on: drafts are masked per position by the grammar (a refused
    draft is rejected), accepted drafts advance it; every output still validates."""
    spec = LLM(max_model_len=512, max_num_seqs=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    schemas = SCHEMAS[:16]
    prompts = [chat(spec, f"Repeat this JSON: {json.dumps({k: 1 for k in s['properties']})}. Answer with a JSON "
                          f"object with the fields {', '.join(s['properties'])}.") for s in schemas]
    for temperature in (0.0, 0.8):
        params = [SamplingParams(temperature=temperature, seed=i, max_tokens=MAX_TOKENS,
                                 structured_outputs=StructuredOutputsParams(json=s)) for i, s in enumerate(schemas)]
        for schema, out in zip(schemas, spec.generate(prompts, params, use_tqdm=False)):
            c = out.outputs[0]
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_ignore_eos_keeps_the_output_valid(llm):
    """With ignore_eos the request runs to max_tokens, but past the grammar's end only
    EOS is allowed: the text is still a valid choice."""
    p = SamplingParams(temperature=1.0, seed=2, max_tokens=8, ignore_eos=True,
                       structured_outputs=StructuredOutputsParams(choice=["red", "green"]))
    c = llm.generate([chat(llm, "A colour?")], p, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 8 and c.text in ("red", "green")
