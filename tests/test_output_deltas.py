"""The engine-process wire format: deltas of cumulative outputs decode back to
exactly the outputs the engine produced, step by step."""

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from polyrunner.engine.output_deltas import DeltaDecoder, DeltaEncoder
from polyrunner.outputs import CompletionOutput, Logprob, RequestOutput


@st.composite
def histories(draw):
    """One request's cumulative outputs over its steps: text that mostly grows and
    sometimes loses its tail (a stop string cut off), token ids and logprobs that
    grow, n completions finishing at different steps."""
    n = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 8))
    want_lp = draw(st.booleans())
    texts, ids, lps = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    done = [None] * n
    plp = [None]
    history = []
    for step in range(steps):
        last = step == steps - 1
        if step == 0 and draw(st.booleans()):
            plp = plp + [{3: Logprob(-0.5, 1, "a")}]
        outs = []
        for i in range(n):
            if done[i] is None:
                if texts[i] and draw(st.integers(0, 4)) == 0:
                    texts[i] = texts[i][:draw(st.integers(0, len(texts[i])))]
                texts[i] += draw(st.text(alphabet="ab é\n", max_size=4))
                new = draw(st.lists(st.integers(0, 99), min_size=1, max_size=2))
                ids[i] = ids[i] + new
                if want_lp:
                    lps[i] = lps[i] + [{t: Logprob(-1.0 * t, 1, str(t))} for t in new]
                if last or draw(st.integers(0, 5)) == 0:
                    done[i] = draw(st.sampled_from(["stop", "length"]))
            outs.append(CompletionOutput(i, texts[i], list(ids[i]), -1.5 if want_lp else None,
                                         list(lps[i]) if want_lp else None, done[i], None))
        finished = all(d is not None for d in done)
        history.append(RequestOutput("r", "prompt", [1, 2, 3], list(plp), outs, finished, num_cached_tokens=2))
        if finished:
            break
    return history


@settings(max_examples=200, deadline=None)
@given(st.lists(histories(), min_size=1, max_size=3))
def test_deltas_rebuild_every_cumulative_output(requests):
    enc, dec = DeltaEncoder(), DeltaDecoder()
    # interleave the requests' steps as an engine would report them
    named = [[RequestOutput(f"r{k}", **_fields(o)) for o in h] for k, h in enumerate(requests)]
    for step in range(max(map(len, named))):
        outs = [h[step] for h in named if step < len(h)]
        deltas = pickle.loads(pickle.dumps(enc.encode(outs)))
        assert [dec.decode(d) for d in deltas] == outs
    assert len(dec) == 0 and not enc._sent   # finished requests are forgotten on both sides


def _fields(o: RequestOutput) -> dict:
    return dict(prompt=o.prompt, prompt_token_ids=o.prompt_token_ids, outputs=o.outputs,
                prompt_logprobs=o.prompt_logprobs, finished=o.finished, num_cached_tokens=o.num_cached_tokens,
                error=o.error)


def test_a_delta_carries_only_what_is_new():
    enc = DeltaEncoder()
    first = RequestOutput("r", "p", [1] * 100, outputs=[CompletionOutput(0, "Hello", [5, 6])])
    second = RequestOutput("r", "p", [1] * 100, outputs=[CompletionOutput(0, "Hello world", [5, 6, 7])])
    d1, = enc.encode([first])
    d2, = enc.encode([second])
    assert d1[1] == ("p", [1] * 100)      # the prompt travels once
    assert d2[1] is None
    assert d2[6] == [(0, 5, " world", [7], None, None, None, None)]


def test_a_snapshot_never_changes_after_later_deltas():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    a = dec.decode(enc.encode([RequestOutput("r", None, [1], outputs=[CompletionOutput(0, "x", [4])])])[0])
    dec.decode(enc.encode([RequestOutput("r", None, [1], outputs=[CompletionOutput(0, "xy", [4, 5])])])[0])
    assert a.outputs[0].token_ids == [4] and a.outputs[0].text == "x"
