"""`LLM.generate_stream`: partial outputs grow, the final one equals `generate`'s,
and a caller that stops iterating early leaves no KV block behind."""

import pytest

from polyrunner import LLM, SamplingParams
from test_stop_strings_engine import _spanning_stop, ascii_word_tokens, make_tokenizer_folder


@pytest.fixture(scope="module")
def llm(tiny_model_factory, tmp_path_factory):
    folder, _ = tiny_model_factory("llama")
    out = make_tokenizer_folder(folder, tmp_path_factory.mktemp("tiny-llama-stream"))
    return LLM(str(out), backend="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=32)


PROMPTS = ["naïve café über", "10€ kato rime", {"prompt_token_ids": [1] + list(range(60, 110))},
           "sustop heor", "日本語 señor anel"]


@pytest.fixture(scope="module")
def requests(llm):
    """Prompts and params: random seeded, with logprobs, n=2, and spanning stop strings."""
    words = ascii_word_tokens(llm.tokenizer)
    base = [SamplingParams(temperature=1.0, seed=10 + i, allowed_token_ids=words, max_tokens=12, ignore_eos=True)
            for i in range(len(PROMPTS))]
    plain = llm.generate(PROMPTS, base, use_tqdm=False)
    params = []
    for i, (sp, out) in enumerate(zip(base, plain)):
        update = {}
        if i in (1, 3):
            update["stop"] = [_spanning_stop(llm.tokenizer, out.outputs[0].token_ids)]
        if i == 2:
            update.update(n=2, logprobs=2)
        if i == 4:
            update.update(allowed_token_ids=None, max_tokens=10)  # any token, multi-byte ones included
        params.append(sp.model_copy(update=update))
    return params


def _normal(out):
    """A RequestOutput without its request id (each call numbers its requests)."""
    return (out.prompt, out.prompt_token_ids, out.prompt_logprobs, out.finished, out.error,
            [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in out.outputs])


def _assert_clean(llm: LLM) -> None:
    eng = llm.engine
    pool = eng.kv.pool
    assert not eng.has_unfinished_requests()
    assert not eng.kv.blocks and pool.num_free_blocks == pool.num_usable_blocks
    assert (pool.ref_cnt[1:] == 0).all()
    assert not eng.outputs._parents and not eng.outputs._completions


def test_stream_grows_and_ends_like_generate(llm, requests):
    expected = llm.generate(PROMPTS, requests, use_tqdm=False)
    assert any(o.outputs[0].finish_reason == "stop" for o in expected)  # stop strings were hit
    seen: dict[str, list] = {}
    for out in llm.generate_stream(PROMPTS, requests):
        seen.setdefault(out.request_id, []).append(out)
    assert len(seen) == len(PROMPTS)
    finals = []
    for rid in sorted(seen, key=int):  # ids count up in prompt order
        outs = seen[rid]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert len(outs) > 1, "nothing was streamed before the end"
        for prev, cur in zip(outs, outs[1:]):
            assert sum(len(c.token_ids) for c in cur.outputs) > sum(len(c.token_ids) for c in prev.outputs)
            for p, c in zip(prev.outputs, cur.outputs):
                assert c.token_ids[:len(p.token_ids)] == p.token_ids
                assert c.text.startswith(p.text)  # text is only ever extended
                if c.logprobs is not None:
                    assert len(c.logprobs) == len(c.token_ids)
        finals.append(outs[-1])
    assert [_normal(o) for o in finals] == [_normal(o) for o in expected]
    _assert_clean(llm)


@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_breaking_out_early_frees_every_block(llm, requests, stop_after):
    for i, _ in enumerate(llm.generate_stream(PROMPTS, requests)):
        assert llm.engine.kv.num_held_blocks() > 0
        if i == stop_after:
            break
    _assert_clean(llm)
    # the engine is still sound: the next run gives the usual outputs
    again = llm.generate(PROMPTS[:2], requests[:2], use_tqdm=False)
    assert llm.engine.runner.states.num_active == 0  # generate ends with the step that drops them
    assert [_normal(o) for o in again] == [_normal(o) for o in llm.generate(PROMPTS[:2], requests[:2],
                                                                             use_tqdm=False)]
    _assert_clean(llm)


def test_closing_a_held_stream_frees_every_block(llm, requests):
    stream = llm.generate_stream(PROMPTS, requests)
    next(stream)
    next(stream)
    assert llm.engine.has_unfinished_requests()
    stream.close()
    _assert_clean(llm)


def test_invalid_prompt_in_a_stream_leaves_nothing_behind(llm, requests):
    bad = SamplingParams(stop_token_ids=[10_000])
    with pytest.raises(ValueError):
        for _ in llm.generate_stream(PROMPTS[:2], [requests[0], bad]):
            pass
    try:
        _assert_clean(llm)
    finally:
        for rid in list(llm.engine.outputs._parents):
            llm.engine.abort_request(rid)
        llm.engine.step()
