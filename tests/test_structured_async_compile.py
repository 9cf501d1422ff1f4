"""Structured-output grammars compile off the engine's step (`GrammarCompilePool`):
a request waits in WAITING_FOR_FSM while the others keep stepping, runs once its
grammar is ready, fails alone (a ValueError -> HTTP 400) when its grammar is
invalid, nested too deeply or slower than the time limit, and leaks nothing
when aborted mid-compile. The engine tests drive a gated compiler (the real one
behind an Event), so they are fast and deterministic; the server tests check
that a real slow xgrammar compile leaves other streams flowing, and that a
compile past the limit is answered 400."""

from __future__ import annotations

import re
import threading
import time

import openai
import pytest

from polyrunner import LLM, SamplingParams
from polyrunner.engine.async_llm import AsyncLLM
from polyrunner.engine.engine_loop import EngineLoop, ThreadInbox
from polyrunner.engine.request import RequestStatus
from polyrunner.sampling_params import StructuredOutputsParams
from polyrunner.tools.serve.api_server import build_app

pytest.importorskip("xgrammar")
pytest.importorskip("gguf")

from polyrunner.structured.compile_pool import GrammarCompilePool
from polyrunner.structured.compiler import GrammarCompiler
from test_serve import ServerThread, wait_idle

MODEL = "smol"
REGEX = r"[A-Z]{2}-\d{3}"
FREE = SamplingParams(temperature=0.0, max_tokens=16)


def regex_params(regex: str = REGEX, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=regex), **kw)


def deep_schema(depth: int) -> str:
    """A JSON schema string of `depth` nested objects (slow to compile, deep to parse)."""
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth


def wide_schema(depth: int, width: int) -> dict:
    """`depth` nested objects with `width` scalar siblings each: within a request body's
    nesting limit, yet seconds to compile."""
    props = {"a": {"type": "string"} if depth == 1 else wide_schema(depth - 1, width)}
    props.update({f"s{i}": {"type": ("integer", "string", "boolean")[i % 3]} for i in range(width)})
    return {"type": "object", "properties": props, "required": list(props)}


class GatedCompiler:
    """The real compiler behind a gate: `compile` blocks until `gate` is set. Its cache
    is seen (`lookup`) only with `use_cache`, so a gated request always waits."""

    def __init__(self, real: GrammarCompiler, raises: BaseException | None = None, use_cache: bool = False) -> None:
        self.real = real
        self.raises = raises
        self.use_cache = use_cache
        self.gate = threading.Event()
        self.started = threading.Event()
        self.calls: list[tuple[str, str]] = []

    def lookup(self, key):
        return self.real.lookup(key) if self.use_cache else None

    def compile(self, params: StructuredOutputsParams):
        self.calls.append(params.key())
        self.started.set()
        assert self.gate.wait(30), "the test never opened the gate"
        if self.raises is not None:
            raise self.raises
        return self.real.compile(params)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def real_compiler(llm):
    eng = llm.engine
    return GrammarCompiler(eng.tokenizer, eng.arch.vocab_size, {*eng.arch.eos_token_ids, *eng.tokenizer.eos_token_ids})


@pytest.fixture
def engine(llm):
    """The engine with its own grammar pool restored afterwards; nothing may be left held."""
    eng = llm.engine
    saved = eng.grammar_pool
    yield eng
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    if eng.grammar_pool is not saved:
        eng.grammar_pool.shutdown()
    eng.grammar_pool = saved
    assert_idle(eng)


def install(eng, compiler, timeout_s: float = 30.0, **kw) -> GrammarCompilePool:
    eng.grammar_pool = GrammarCompilePool(compiler, timeout_s, **kw)
    return eng.grammar_pool


def assert_idle(eng) -> None:
    pool = eng.kv.pool
    assert not eng.has_unfinished_requests() and eng.scheduler.num_unfinished == 0
    assert not eng.scheduler.waiting_for_fsm and not eng.scheduler.requests
    if eng.scheduler.has_finished_requests():
        eng.step()   # a step without rows hands the finished slots to the runner
    assert pool.num_free_blocks == pool.num_usable_blocks and eng.runner.states.num_active == 0


def reference(llm, prompt: str, params: SamplingParams) -> str:
    """The text the synchronous path (grammar compiled at admission) gives."""
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def run_until(eng, done, max_steps: int = 400) -> dict[str, object]:
    """Step until `done(last outputs)`; returns the last output of each request."""
    last: dict[str, object] = {}
    for _ in range(max_steps):
        for out in eng.step():
            last[out.request_id] = out
        if done(last):
            return last
    raise AssertionError(f"not done after {max_steps} steps: {last}")


# ---- the engine -----------------------------------------------------------------------------


def test_others_step_while_a_grammar_compiles_then_it_runs(llm, engine, real_compiler):
    want_free = reference(llm, "Once upon a time", FREE)
    want_g = reference(llm, "An order code:", regex_params())
    gated = GatedCompiler(real_compiler)
    pool = install(engine, gated)
    engine.add_request("Once upon a time", FREE, request_id="free", stream=True)
    engine.add_request("An order code:", regex_params(), request_id="g", stream=True, wait_for_grammar=False)
    g = engine.scheduler.waiting_for_fsm["g"]
    assert g.status == RequestStatus.WAITING_FOR_FSM and pool.num_pending == 1
    assert gated.started.wait(10)
    counts = []
    for _ in range(6):   # (a) the free request advances every step; g holds no slot, no block
        outs = {o.request_id: o for o in engine.step()}
        assert set(outs) == {"free"}
        counts.append(len(outs["free"].outputs[0].token_ids))
        assert g.slot is None and g.request_id not in engine.kv.blocks
    assert counts == list(range(1, 7))
    gated.gate.set()   # (b) ready: scheduled at a later step, and its output is the synchronous one
    last = run_until(engine, lambda last: all(o.finished for o in last.values()) and len(last) == 2)
    assert last["free"].outputs[0].text == want_free
    assert last["g"].outputs[0].text == want_g and re.fullmatch(REGEX, want_g)
    assert last["g"].outputs[0].finish_reason == "stop" and last["g"].error is None
    assert len(gated.calls) == 1 and pool.num_pending == 0 and pool.num_jobs == 0


def test_same_constraint_compiles_once_and_the_cache_still_works(engine, real_compiler):
    gated = GatedCompiler(real_compiler, use_cache=True)
    pool = install(engine, gated)
    fresh = regex_params(r"[a-f]{4}-\d{2}")
    engine.add_request("Code:", fresh, request_id="a", wait_for_grammar=False)
    engine.add_request("Code:", fresh.model_copy(update={"n": 2}), request_id="b", wait_for_grammar=False)
    assert len(engine.scheduler.waiting_for_fsm) == 3   # a, b#0, b#1
    gated.gate.set()
    last = run_until(engine, lambda last: {"a", "b"} <= set(last))
    assert len(gated.calls) == 1   # one compile for the three sequences
    for out in last.values():
        assert all(re.fullmatch(r"[a-f]{4}-\d{2}", c.text) for c in out.outputs), out
    engine.add_request("Code:", fresh, request_id="c", wait_for_grammar=False)   # cached: no wait at all
    assert engine.scheduler.requests["c"].status == RequestStatus.WAITING and not engine.scheduler.waiting_for_fsm
    assert pool.num_pending == 0 and len(gated.calls) == 1
    run_until(engine, lambda last: "c" in last)


def test_timeout_fails_that_request_alone(llm, engine, real_compiler):
    want_free = reference(llm, "Once upon a time", FREE)
    clock = FakeClock()
    gated = GatedCompiler(real_compiler)
    pool = install(engine, gated, timeout_s=5.0, clock=clock)
    engine.add_request("Once upon a time", FREE, request_id="free", stream=True)
    engine.add_request("Code:", regex_params(r"slow\d"), request_id="g", stream=True, wait_for_grammar=False)
    for _ in range(3):
        assert {o.request_id for o in engine.step()} == {"free"} and not engine.rejected
    clock.now = 5.0   # past g's deadline: the next step fails g, and only g
    outs = {o.request_id: o for o in engine.step()}
    (rid, error), = engine.rejected
    assert rid == "g" and isinstance(error, ValueError)
    assert "structured_outputs.regex: the grammar did not compile within 5 s" in str(error)
    assert outs["g"].finished and outs["g"].error == str(error) and outs["g"].outputs[0].finish_reason == "error"
    assert outs["g"].outputs[0].token_ids == [] and "free" in outs
    last = run_until(engine, lambda last: last.get("free") is not None and last["free"].finished)
    assert last["free"].outputs[0].text == want_free and "g" not in last
    assert pool.num_pending == 0 and pool.num_jobs == 1   # the compile still runs: it cannot be stopped
    gated.gate.set()
    deadline = time.monotonic() + 10
    while pool.num_jobs and time.monotonic() < deadline:
        engine.step()   # polls: the ended compile is forgotten; its grammar is in the compiler's cache
        time.sleep(0.01)
    assert pool.num_jobs == 0 and real_compiler.lookup(StructuredOutputsParams(regex=r"slow\d").key()) is not None


def test_abort_during_compile_leaks_nothing(engine, real_compiler):
    gated = GatedCompiler(real_compiler)
    pool = install(engine, gated, max_workers=1)
    engine.add_request("Code:", regex_params(r"run\d", n=2), request_id="running", wait_for_grammar=False)
    assert gated.started.wait(10)   # its compile occupies the only worker ...
    engine.add_request("Code:", regex_params(r"queued\d"), request_id="queued", wait_for_grammar=False)
    assert pool.num_pending == 2 and pool.num_jobs == 2   # ... so this one is queued
    engine.abort_request("queued")
    engine.abort_request("running")
    assert_idle(engine)
    assert pool.num_pending == 0 and pool.num_jobs == 1   # the running compile cannot be stopped
    gated.gate.set()
    deadline = time.monotonic() + 10
    while pool.num_jobs and time.monotonic() < deadline:
        assert engine.step() == []
        time.sleep(0.01)
    assert pool.num_jobs == 0 and gated.calls == [StructuredOutputsParams(regex=r"run\d").key()]   # never ran
    assert not engine.rejected
    assert_idle(engine)


def test_grammar_errors_are_value_errors(engine, real_compiler):
    install(engine, real_compiler)
    engine.add_request("Code:", regex_params("a(b"), request_id="bad", wait_for_grammar=False)
    last = run_until(engine, lambda last: "bad" in last)
    (rid, error), = engine.rejected
    assert rid == "bad" and isinstance(error, ValueError) and "structured_outputs.regex" in str(error)
    assert last["bad"].error == str(error)
    with pytest.raises(ValueError, match=re.escape("structured_outputs.regex")):   # the synchronous path
        engine.add_request("Code:", regex_params("a(b"))
    with pytest.raises(ValueError, match="nested too deeply"):   # RecursionError of Python's JSON parser
        StructuredOutputsParams(json=deep_schema(900))
    nested: dict = {"type": "string"}
    for _ in range(600):
        nested = {"type": "object", "properties": {"a": nested}}
    with pytest.raises(ValueError, match="nested too deeply"):   # keyed at admission
        engine.add_request("Code:", SamplingParams(structured_outputs=StructuredOutputsParams(json=nested)),
                           wait_for_grammar=False)
    install(engine, GatedCompiler(real_compiler, raises=RecursionError("maximum recursion depth exceeded")))
    engine.grammar_pool.compiler.gate.set()
    engine.add_request("Code:", regex_params(r"x\d"), request_id="deep", wait_for_grammar=False)
    run_until(engine, lambda last: "deep" in last)
    (rid, error), = engine.rejected
    assert rid == "deep" and str(error) == "structured_outputs.regex: the constraint is nested too deeply to be parsed"


def test_synchronous_admission_waits_under_the_time_limit(engine, real_compiler):
    gated = GatedCompiler(real_compiler)
    pool = install(engine, gated, timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="did not compile within 0.2 s"):
        engine.add_request("Code:", regex_params(r"sync\d"))
    assert time.monotonic() - t0 < 5 and pool.num_pending == 0
    assert_idle(engine)
    gated.gate.set()


def test_engine_loop_reports_a_failed_grammar_as_rejected(engine, real_compiler):
    """The serving loop never waits for a compile at add, and a grammar that fails later
    reaches the frontend as ("rejected", id, ("ValueError", message)) — mapped to 400."""
    gated = GatedCompiler(real_compiler)
    install(engine, gated, timeout_s=30.0)
    inbox, reports, done = ThreadInbox(), [], threading.Event()

    def report(events, counts):
        reports.append((events, counts))
        seen = [e for evs, _ in reports for e in evs]
        if (any(e[0] == "rejected" for e in seen) and any(
                e[0] == "outputs" and any(o.request_id == "free" and o.finished for o in e[1]) for e in seen)):
            done.set()

    loop = EngineLoop(engine, inbox, report)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    inbox.put([("add", "bad", "Code:", regex_params("a(b"), 0, None),
               ("add", "free", "Once upon a time", FREE, 0, None)])
    assert gated.started.wait(10)
    deadline = time.monotonic() + 30   # the add returned: the loop steps "free" while "bad" compiles
    while not any(e[0] == "outputs" and any(o.request_id == "free" for o in e[1])
                  for evs, _ in list(reports) for e in evs):
        assert time.monotonic() < deadline, "the loop did not step while a grammar compiled"
        time.sleep(0.01)
    gated.gate.set()
    assert done.wait(60)
    inbox.put([("stop",)])
    thread.join(30)
    events = [e for evs, _ in reports for e in evs]
    rejected = [e for e in events if e[0] == "rejected"]
    assert len(rejected) == 1 and rejected[0][1] == "bad" and rejected[0][2][0] == "ValueError"
    assert "structured_outputs.regex" in rejected[0][2][1]
    assert not any(o.request_id == "bad" for e in events if e[0] == "outputs" for o in e[1])
    assert max(c.num_waiting for _, c in reports) >= 1   # counted while it waited for its grammar


# ---- the server ---------------------------------------------------------------------------


def test_server_streams_flow_while_a_real_grammar_compiles(monkeypatch):
    """A schema xgrammar takes seconds to compile (after building its tokenizer info,
    also seconds): another stream's chunks keep coming (before: the engine loop
    stopped for the whole compile), and the structured request then runs. (A
    generous time limit: a loaded test machine compiles several times slower.)"""
    monkeypatch.setenv("POLYRUNNER_GRAMMAR_COMPILE_TIMEOUT_S", "300")   # read by the engine process
    allm = AsyncLLM(max_model_len=512, max_num_seqs=8, engine_process=True)
    srv = ServerThread(build_app(allm, served_model_names=[MODEL]))
    client = srv.client(timeout=120)
    try:
        times: list[float] = []

        def stream() -> None:
            for _ in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=480,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
                times.append(time.monotonic())

        free = threading.Thread(target=stream)
        free.start()
        deadline = time.monotonic() + 60
        while len(times) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        sent = time.monotonic()
        r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"json": wide_schema(95, 4)}})
        answered = time.monotonic()
        free.join(120)
        assert r.choices[0].text.startswith("{")
        during = [b - a for a, b in zip(times, times[1:]) if b > sent]
        flowed = sum(sent < t < answered for t in times)   # chunks that came while the grammar compiled
        assert answered - sent > 0.5 and flowed >= 3, f"the compile did not overlap the stream ({flowed} chunks)"
        # blocked, the stream would stop for the whole compile; a loaded machine adds pauses of its
        # own, so the bound is 1 s or 40% of the compile, whichever is longer
        bound = max(1.0, 0.4 * (answered - sent))
        assert max(during) < bound, f"a stream stalled {max(during):.2f} s while a grammar compiled " \
                                    f"({answered - sent:.2f} s)"
        wait_idle(allm)
    finally:
        srv.stop()
        allm.shutdown(0)


def test_server_answers_400_for_a_grammar_past_the_limit_or_too_deep(real_compiler):
    allm = AsyncLLM(max_model_len=256, max_num_seqs=4, engine_process=False)
    gated = GatedCompiler(real_compiler)
    allm.engine.grammar_pool = GrammarCompilePool(gated, timeout_s=0.3)
    srv = ServerThread(build_app(allm, served_model_names=[MODEL]))
    client = srv.client()
    try:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=8, stream=stream,
                                              extra_body={"structured_outputs": {"regex": rf"slow{int(stream)}"}})
                list(r) if stream else r
            assert info.value.status_code == 400 and info.value.body["param"] == "structured_outputs"
            assert "did not compile within 0.3 s" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="JSON:", max_tokens=8,
                                      extra_body={"structured_outputs": {"json": deep_schema(900)}})
        assert info.value.status_code == 400 and "structured_outputs.json" in info.value.message
        ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)   # the engine is fine
        assert ok.choices[0].finish_reason == "length"
        wait_idle(allm)
    finally:
        gated.gate.set()
        srv.stop()
        allm.shutdown(0)
