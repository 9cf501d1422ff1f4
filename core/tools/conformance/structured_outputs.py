"""Structured outputs end to end on the tiny random Llama: JSON-schema, regex and
choice constraints hold on every output, greedy and seeded, so the grammar's
token bitmask reached the backend's sampler; an invalid constraint is refused
before scheduling. The tiny model gets a byte-level tokenizer of its own (ASCII
characters plus a few multi-character tokens, fewer ids than the model's
vocabulary, so the mask's padding is exercised). Registered in `end_to_end`;
skipped where xgrammar (the extra `polyrunner[structured]`) is not installed."""

from __future__ import annotations

import json
import re
from pathlib import Path

from polyrunner.tools.conformance.framework import MODEL_RUNS, check, expect, fail

MAX_TOKENS = 48
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "color", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "color": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}}}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue"]
_WORDS = ['{"', '":', '",', '"}', "true", "false", "red", "blue", "green", "color", "ok", "ab", "12"]


def write_byte_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer without merges: <pad>, <s>, </s> (ids 0-2, the tiny
    Llama's BOS/EOS), printable ASCII and newline, then `_WORDS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from polyrunner.models.gguf.vocab import bytes_to_unicode
    folder.mkdir(parents=True, exist_ok=True)
    to_char = bytes_to_unicode()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for b in [10, *range(32, 127)]:
        vocab[to_char[b]] = len(vocab)
    for w in _WORDS:
        vocab.setdefault("".join(to_char[b] for b in w.encode()), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def _engine(ctx):
    if "structured_engine" not in ctx.cache:
        from polyrunner.engine.llm_engine import LLMEngine
        cfg = ctx.engine_config("e2e")
        cfg.model.tokenizer = str(write_byte_tokenizer(ctx.workdir / "byte-tokenizer"))
        ctx.cache["structured_engine"] = LLMEngine(cfg)
    return ctx.cache["structured_engine"]


def _valid_json(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"n", "color", "ok"} and type(v["n"]) is int
            and 0 <= v["n"] <= 99 and v["color"] in ("red", "blue") and isinstance(v["ok"], bool))


@check("end_to_end", requires=("sampling:structured_outputs",), packages={"xgrammar": "structured"},
       depends_on=MODEL_RUNS)
def check_structured_outputs(ctx) -> str:
    """JSON-schema, regex and choice outputs match their constraint (greedy and, where
    the device seeds, random); an invalid regex is refused before scheduling."""
    from polyrunner.sampling_params import SamplingParams, StructuredOutputsParams
    from polyrunner.tools.conformance.context import generate
    engine = _engine(ctx)
    specs = [(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), "json", _valid_json),
             (StructuredOutputsParams(regex=REGEX), "regex", lambda t: re.fullmatch(REGEX, t) is not None),
             (StructuredOutputsParams(choice=CHOICES), "choice", lambda t: t in CHOICES)]
    seeded = {"temperature", "seed"} <= ctx.capabilities.sampling
    prompts, params, kinds = [], [], []
    for i, p in enumerate(ctx.prompts()):
        for j, (spec, name, valid) in enumerate(specs):
            random_row = seeded and (i + j) % 2 == 1
            params.append(SamplingParams(temperature=1.0 if random_row else 0.0, seed=7 * i + j if random_row else None,
                                         max_tokens=MAX_TOKENS, structured_outputs=spec))
            prompts.append(p)
            kinds.append((name, valid, random_row))
    outs = generate(engine, prompts, params)
    eos = engine.tokenizer.eos_token_id
    for i, (ids, (name, valid, random_row)) in enumerate(zip(outs, kinds)):
        mode = "random" if random_row else "greedy"
        if not ids or ids[-1] != eos:
            fail(f"{name} ({mode}) request {i} did not end with EOS within {MAX_TOKENS} tokens: "
                 f"{engine.tokenizer.decode(ids)!r} (ids {ids}); is the grammar bitmask applied by the sampler?")
        text = engine.tokenizer.decode(ids)
        expect(valid(text), f"{name} ({mode}) request {i}: output {text!r} does not match its constraint")
    before = engine.scheduler.num_unfinished
    try:
        engine.add_request({"prompt_token_ids": [5, 6]},
                           SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")))
    except ValueError as exc:
        expect("structured_outputs.regex" in str(exc), f"the refusal does not name the field: {exc}")
    else:
        fail("an invalid regex was accepted")
    expect(engine.scheduler.num_unfinished == before, "the refused request was scheduled")
    return f"{len(outs)} constrained outputs (json, regex, choice; {'greedy+random' if seeded else 'greedy'}) valid"
