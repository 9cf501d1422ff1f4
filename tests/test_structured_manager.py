"""Structured-output pieces without a model: the bitmask op against xgrammar's own,
the compile cache, per-slot matchers (accept, rollback, sync with placeholders),
draft-token masks for speculative decoding, pickling for tensor-parallel workers,
and the sampling state + sampler honouring the mask."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from polyrunner.sample import SamplingState
from polyrunner.sample.grammar import apply_token_bitmask, unpack_bitmask
from polyrunner.sample.sampler import Sampler
from polyrunner.sampling_params import SamplingParams, StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")

from polyrunner.structured.compiler import GrammarCompiler  # noqa: E402
from polyrunner.structured.manager import StructuredOutputManager  # noqa: E402

EOS = 1
MODEL_VOCAB = 300   # > the tokenizer's 256 + specials, not a multiple of 32: the mask is padded


@pytest.fixture(scope="module")
def compiler():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = ['{"a": 1, "b": [true, false]}', "code 123-ab", "yes no maybe", "(1+2)*3"] * 50
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<pad>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    return GrammarCompiler(tok, MODEL_VOCAB, [EOS])


def compiled(compiler, **spec) -> StructuredOutputsParams:
    p = StructuredOutputsParams(**spec)
    p.compiled = compiler.compile(p)
    return p


def allowed_ids(bitmask_row: torch.Tensor) -> np.ndarray:
    return np.flatnonzero(unpack_bitmask(bitmask_row[None], MODEL_VOCAB)[0].numpy())


def decode(compiler, ids) -> str:
    return b"".join(compiler.info.decoded_vocab[i] for i in ids).decode()


# ---- the op -------------------------------------------------------------------------------


def test_bitmask_op_matches_xgrammar():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, MODEL_VOCAB, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 10), generator=g, dtype=torch.int64).to(torch.int32)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, vocab_size=MODEL_VOCAB)
    assert torch.equal(apply_token_bitmask(logits, bitmask), ref)
    rows = torch.tensor([0, 3])
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask, indices=[0, 3], vocab_size=MODEL_VOCAB)
    out = apply_token_bitmask(logits, bitmask[rows], rows)
    assert torch.equal(out, ref) and torch.equal(out[[1, 2, 4]], logits[[1, 2, 4]])
    # a mask narrower than the vocabulary refuses the ids past it
    narrow = apply_token_bitmask(logits, torch.full((5, 2), -1, dtype=torch.int32))
    assert torch.isinf(narrow[:, 64:]).all() and torch.equal(narrow[:, :64], logits[:, :64])


# ---- compiling ------------------------------------------------------------------------------


def test_compile_cache_and_errors(compiler):
    n = compiler.num_compiled
    a = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = compiler.compile(StructuredOutputsParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    assert a is b and compiler.num_compiled == n + 1     # same schema, other key order: one compile
    c = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}},
                                                 disable_any_whitespace=True))
    assert c is not a and compiler.num_compiled == n + 2
    assert a.tokenizer_info.vocab_size == MODEL_VOCAB
    for spec, field in [(dict(regex="[a-"), "structured_outputs.regex"),
                        (dict(grammar="root ::= x"), "structured_outputs.grammar"),
                        (dict(json={"type": "strin"}), "structured_outputs.json")]:
        with pytest.raises(ValueError, match=re.escape(field)):
            compiler.compile(StructuredOutputsParams(**spec))


def test_pickle_and_clone_keep_the_grammar(compiler):
    p = SamplingParams(structured_outputs=compiled(compiler, regex=r"\d+-[a-z]{2}"))
    back = pickle.loads(pickle.dumps(p))
    assert back.structured_outputs.compiled is not None and back.structured_outputs.regex == r"\d+-[a-z]{2}"
    assert p.clone().structured_outputs.compiled is p.structured_outputs.compiled
    m = StructuredOutputManager(2, MODEL_VOCAB)
    m.add(0, back.structured_outputs)
    assert m.accept(0, [compiler.info.decoded_vocab.index(b"1")])


# ---- matchers -------------------------------------------------------------------------------


def walk(compiler, m: StructuredOutputManager, slot: int, rng: np.random.Generator, limit: int = 40) -> list[int]:
    """Sample allowed tokens (uniformly) until EOS; returns the ids before EOS."""
    out: list[int] = []
    for _ in range(limit):
        bitmask, rows = m.fill_bitmask(np.array([slot]))
        assert rows.tolist() == [0]
        tok = int(rng.choice(allowed_ids(bitmask[0])))
        assert m.accept(slot, [tok])
        if tok == EOS:
            return out
        out.append(tok)
    raise AssertionError("no EOS within the limit")


@pytest.mark.parametrize("spec, check", [
    (dict(regex=r"\d{2,3}-[a-z]{2}"), lambda s: re.fullmatch(r"\d{2,3}-[a-z]{2}", s)),
    (dict(choice=["yes", "no", "maybe"]), lambda s: s in ("yes", "no", "maybe")),
    (dict(grammar='root ::= "(" [1-9] ("+" [1-9])? ")"'), lambda s: re.fullmatch(r"\([1-9](\+[1-9])?\)", s)),
])
def test_random_walks_follow_the_grammar(compiler, spec, check):
    m = StructuredOutputManager(4, MODEL_VOCAB)
    m.add(2, compiled(compiler, **spec))
    rng = np.random.default_rng(0)
    for _ in range(10):
        text = decode(compiler, walk(compiler, m, 2, rng))
        assert check(text), text
        m.add(2, compiled(compiler, **spec))
    # EOS is refused before the grammar may end, and only EOS is left after it is complete
    bitmask, _ = m.fill_bitmask(np.array([2]))
    assert EOS not in allowed_ids(bitmask[0])


def test_accept_refusal_rollback_and_sync(compiler):
    m = StructuredOutputManager(3, MODEL_VOCAB)
    m.add(1, compiled(compiler, regex=r"ab(c|d)"))
    ids = {s: compiler.info.decoded_vocab.index(s.encode()) for s in "abcdx"}
    before = m.fill_bitmask(np.array([1]))[0].clone()
    assert not m.accept(1, [ids["a"], ids["x"]])        # refused: nothing advanced
    assert torch.equal(m.fill_bitmask(np.array([1]))[0], before)
    assert m.accept(1, [ids["a"], ids["b"]]) and m.num_accepted[1] == 2
    m.rollback(1, 1)
    assert m.num_accepted[1] == 1 and allowed_ids(m.fill_bitmask(np.array([1]))[0]).tolist() == [ids["b"]]
    # sync: slot 1's row holds 2 prompt tokens then the output; -1 is a token still on the device
    token_ids = np.full((3, 16), 7, np.int32)
    token_ids[1, 2:6] = [ids["a"], ids["b"], ids["c"], -1]
    m.rollback(1, 1)
    errors = m.sync(np.array([0, 1]), token_ids, np.array([2, 2, 2]), np.array([2, 6, 2]))
    assert errors == {} and m.num_accepted[1] == 3
    assert allowed_ids(m.fill_bitmask(np.array([1]))[0]).tolist() == [EOS]
    token_ids[1, 5] = ids["x"]
    errors = m.sync(np.array([1]), token_ids, np.array([2, 2, 2]), np.array([2, 6, 2]))
    assert "refused" in errors[1] and 1 not in m.matchers


def test_draft_masks_and_rollback(compiler):
    """fill_bitmask with draft tokens: row i's k+1 masks equal stepwise fills; the state
    is unchanged afterwards; after a refused draft the masks are all ones."""
    m = StructuredOutputManager(4, MODEL_VOCAB)
    spec = compiled(compiler, regex=r"12[a-c]{3}")
    m.add(0, spec)
    m.add(3, spec)
    ids = {s: compiler.info.decoded_vocab.index(s.encode()) for s in "12abcx"}
    drafts = [[ids["1"], ids["2"], ids["a"]], [ids["x"]], [ids["1"], ids["x"], ids["a"]]]
    slots = np.array([0, 2, 3])   # slot 2 has no grammar
    before = m.fill_bitmask(slots)[0].clone()
    bitmask, rows = m.fill_bitmask(slots, drafts)
    assert bitmask.shape[0] == 4 + 2 + 4
    # stepwise reference for slot 0
    ref = StructuredOutputManager(1, MODEL_VOCAB)
    ref.add(0, spec)
    for j in range(4):
        assert torch.equal(bitmask[j], ref.fill_bitmask(np.array([0]))[0][0])
        if j < 3:
            assert ref.accept(0, [drafts[0][j]])
    assert (bitmask[4:6] == -1).all()   # no grammar: all ones
    # slot 3: "1" ok, "x" refused -> masks 0 and 1 filled, the rest all ones
    assert torch.equal(bitmask[6], bitmask[0]) and torch.equal(bitmask[7], bitmask[1])
    assert (bitmask[8:10] == -1).all()
    assert rows.tolist() == [0, 1, 2, 3, 6, 7]
    assert torch.equal(m.fill_bitmask(slots)[0], before) and m.num_accepted[[0, 3]].tolist() == [0, 0]


# ---- sampling state + sampler ---------------------------------------------------------------


def test_sampling_state_masks_only_grammar_rows(compiler):
    state = SamplingState(4, MODEL_VOCAB, torch.device("cpu"))
    ids = {s: compiler.info.decoded_vocab.index(s.encode()) for s in "xyz"}
    state.add_row(0, SamplingParams(temperature=0.0), None)
    state.add_row(2, SamplingParams(temperature=0.0, structured_outputs=compiled(compiler, choice=["z"])), None)
    state.add_row(3, SamplingParams(temperature=1.0, seed=1, structured_outputs=compiled(compiler, choice=["y"])),
                  None)
    token_ids = np.zeros((4, 8), np.int32)
    n = np.array([2, 2, 2, 2], np.int32)
    slots = np.array([0, 2, 3])
    meta = state.make_metadata(slots, token_ids, n, n)
    assert meta.grammar_rows.tolist() == [1, 2] and meta.grammar_bitmask.shape == (2, 10)
    logits = torch.zeros(3, MODEL_VOCAB)
    logits[:, ids["x"]] = 50.0
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [ids["x"], ids["z"], ids["y"]]
    # after the choice is complete only EOS is allowed; a row without grammar: no mask at all
    token_ids[2, 2], token_ids[3, 2] = ids["z"], ids["y"]
    n3 = np.array([2, 2, 3, 3], np.int32)
    meta = state.make_metadata(slots, token_ids, n, n3)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [ids["x"], EOS, EOS]
    state.clear_row(2)
    state.clear_row(3)
    assert state.make_metadata(np.array([0]), token_ids, n, n).grammar_bitmask is None


def test_terminated_grammar_allows_only_eos(compiler):
    m = StructuredOutputManager(2, MODEL_VOCAB)
    m.add(0, compiled(compiler, regex="ab"))
    ids = {s: compiler.info.decoded_vocab.index(s.encode()) for s in "abx"}
    bitmask, rows = m.fill_bitmask(np.array([0]), [[ids["a"], ids["b"], EOS, ids["x"]]])
    assert rows.tolist() == [0, 1, 2, 3]
    allowed = [allowed_ids(bitmask[j]).tolist() for j in range(4)]
    assert ids["a"] in allowed[0] and ids["x"] not in allowed[0]   # (a merged "ab" token too)
    assert allowed[1:] == [[ids["b"]], [EOS], [EOS]]
    assert (bitmask[4] == -1).all() and m.num_accepted[0] == 0
    assert m.accept(0, [ids["a"], ids["b"], EOS])
    bitmask, rows = m.fill_bitmask(np.array([1, 0]))
    assert rows.tolist() == [1] and allowed_ids(bitmask[1]).tolist() == [EOS]
    assert m.accept(0, [EOS, EOS])   # ignore_eos: EOS tokens after the end are taken and ignored
