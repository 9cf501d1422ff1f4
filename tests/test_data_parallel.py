"""Data parallelism (`data_parallel_size=2`): the router's choices; offline `LLM`
equals one replica and spreads its prompts; a served load test with disconnecting
clients spreads over both replicas (per-replica /metrics) and leaves nothing
running or waiting; greedy parity with one replica through the server; killing one
replica's process fails only its requests, /health reports degraded and the other
replica keeps serving."""

import asyncio
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lora_adapters import ATTENTION, make_peft_adapter
from polyrunner import LLM, SamplingParams
from polyrunner.engine.async_llm import AsyncLLM
from polyrunner.engine.core_errors import ReplicaDeadError
from polyrunner.engine.dp_cores import DPCores, _Call
from polyrunner.engine.dp_router import NoReplicaError, Router
from polyrunner.lora.request import LoRARequest
from polyrunner.tools.serve.api_server import build_app
from processes import gone, serve_process
from test_serve import ServerThread

ARGS = dict(backend="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=128)


def _prompt(i: int, length: int = 12) -> dict:
    return {"prompt_token_ids": [1] + [(37 * i + 11 * j) % 500 + 3 for j in range(length - 1)]}


def _greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return tiny_model_factory("llama")[0]


# ----------------------------------------------------------------------- routing


def test_least_loaded_takes_the_emptiest_live_replica():
    r = Router()
    assert r.choose([3, 1, 2], [True, True, True]) == 1
    assert [r.choose([2, 2, 5], [True] * 3) for _ in range(3)] == [0, 1, 0]   # ties go round
    assert r.choose([5, 0, 1], [True, False, True]) == 2  # a dead replica is never chosen, however idle
    with pytest.raises(NoReplicaError, match="every data-parallel replica is dead"):
        r.choose([0, 0], [False, False])


def test_cache_aware_keeps_a_prefix_on_one_replica_unless_it_is_much_busier():
    r = Router("cache_aware", block_size=4, balance_abs_threshold=4, balance_rel_threshold=1.5)
    homes = {r.choose([0, 0, 0, 0], [True] * 4, _prompt(i)) for i in range(32)}
    assert len(homes) > 1                                  # different prefixes spread
    a = {"prompt_token_ids": [1, 2, 3, 4, 9, 9]}
    b = {"prompt_token_ids": [1, 2, 3, 4, 7, 7, 7]}        # same first block: same replica, whatever follows
    home = r.choose([0, 0, 0, 0], [True] * 4, a)
    assert r.choose([0, 0, 0, 0], [True] * 4, b) == home
    loads = [3, 3, 3, 3]
    loads[home] = 7                                        # 4 more (not > 4): stays home
    assert r.choose(loads, [True] * 4, a) == home
    loads[home] = 8                                        # 5 more and > 1.5x: a least loaded one serves
    assert r.choose(loads, [True] * 4, a) != home
    alive = [i != home for i in range(4)]
    assert r.choose([0, 0, 0, 0], alive, a) != home        # its home died: another live replica
    with pytest.raises(ValueError, match="routing='prefix' is not supported; allowed: least_loaded, cache_aware"):
        Router("prefix")


def test_engine_calls_merge_the_replicas_replies():
    def merged(method, *results):
        call = _Call(method, set(), [(i, ok, p) for i, (ok, p) in enumerate(results)])
        return DPCores._merged(7, call)

    assert merged("add_lora", (True, True), (True, True)) == ("reply", 7, True, True)
    assert merged("add_lora", (True, True), (True, False)) == ("reply", 7, True, False)
    assert merged("remove_lora", (True, False), (True, True)) == ("reply", 7, True, True)
    assert merged("list_loras", (True, {1, 2}), (True, {2, 3})) == ("reply", 7, True, {2})
    assert merged("add_lora", (True, True), (False, ("ValueError", "bad rank"))) == \
        ("reply", 7, False, ("ValueError", "replica 1: bad rank"))


# ----------------------------------------------------------------------- offline


def test_llm_dp2_equals_one_replica_and_spreads_the_prompts(folder):
    prompts = [_prompt(i, 8 + 3 * i) for i in range(12)]
    params = [_greedy(6 + i % 5) for i in range(12)]
    one = LLM(str(folder), **ARGS).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(folder), data_parallel_size=2, **ARGS)
    try:
        two = llm.generate(prompts, params, use_tqdm=True)
        assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
        assert [o.prompt_token_ids for o in two] == [p["prompt_token_ids"] for p in prompts]   # prompt order
        taken = [s.counts.adds_applied for s in llm.engine.cores.states()]
        assert sum(taken) == 12 and min(taken) >= 4, taken
        bad = llm.generate([_prompt(0), {"prompt_token_ids": []}], _greedy(), use_tqdm=False)
        assert bad[0].error is None and bad[1].error and bad[1].outputs[0].finish_reason == "error"
    finally:
        llm.shutdown()
    assert all(not s.alive for s in llm.engine.cores.states())


# ------------------------------------------------------------------------- served


def test_serve_command_dp2_equals_one_replica(folder):
    """`polyrunner serve -dp 2` (cache_aware routing): greedy parity, per-replica /metrics,
    SIGTERM stops both replicas."""
    prompts = [_prompt(i, 6 + i)["prompt_token_ids"] for i in range(6)]
    ref = LLM(str(folder), **ARGS).generate([{"prompt_token_ids": p} for p in prompts], _greedy(10), use_tqdm=False)
    with serve_process(str(folder), "--backend", "cpu", "--dtype", "float32", "--max-num-seqs", "8",
                       "--data-parallel-size", "2", "--data-parallel-routing", "cache_aware",
                       "--served-model-name", "tiny", "--log-level", "warning") as (proc, url):
        body = {"model": "tiny", "prompt": prompts, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        got = {c["index"]: c["token_ids"] for c in out["choices"]}
        assert [got[i] for i in range(6)] == [o.outputs[0].token_ids for o in ref]
        text = httpx.get(url + "/metrics").text
        assert 'polyrunner:engine_healthy{model_name="tiny",replica="1"} 1.0' in text
        assert 'polyrunner:num_requests_running{model_name="tiny",replica="total"} 0.0' in text
        replicas = children_of(proc.pid)
        assert len(replicas) >= 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stdout.read()
    assert all(gone(pid, 10) for pid in replicas)


def children_of(pid: int) -> set[int]:
    """Live child processes of `pid` (Linux /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split() if entry.isdigit() else None
        except OSError:
            continue
        if fields and fields[1] == str(pid) and fields[0] != "Z":
            found.add(int(entry))
    return found


@pytest.fixture(scope="module")
def allm(folder):
    a = AsyncLLM(str(folder), data_parallel_size=2, max_model_len=512, **ARGS)
    yield a
    a.shutdown(0)


@pytest.fixture(scope="module")
def srv(allm):
    s = ServerThread(build_app(allm, served_model_names=["tiny"]))
    yield s
    s.stop()


def _samples(srv) -> dict[tuple[str, tuple], float]:
    text = httpx.get(srv.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _metric(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


def test_served_greedy_equals_one_replica(srv, folder):
    prompts = [_prompt(i, 6 + i)["prompt_token_ids"] for i in range(6)]
    ref = LLM(str(folder), **ARGS).generate([{"prompt_token_ids": p} for p in prompts], _greedy(10), use_tqdm=False)
    out = srv.client().completions.create(model="tiny", prompt=prompts, max_tokens=10, temperature=0.0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    got = {c.index: c.model_extra["token_ids"] for c in out.choices}
    assert [got[i] for i in range(6)] == [o.outputs[0].token_ids for o in ref]


def test_load_with_disconnects_spreads_over_both_replicas(srv, allm):
    """64 streaming requests, every 4th dropped once its response started (the tiny model
    outruns a client that reads a few events first: it would be done before the drop)."""
    statuses, dropped, finished = [], [], []

    async def one(k: int, client: httpx.AsyncClient) -> None:
        drop = k % 4 == 0
        body = {"model": "tiny", "prompt": _prompt(k)["prompt_token_ids"], "stream": True, "ignore_eos": True,
                "max_tokens": 480 if drop else 12, "temperature": 0.0}
        async with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            if drop:
                dropped.append(k)
                return
            events = [line for line in [line async for line in r.aiter_lines()] if line]
            assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2].replace(" ", "")
            finished.append(k)

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=80)) as client:
            await asyncio.gather(*(one(k, client) for k in range(64)))

    before = _samples(srv)
    asyncio.run(main())
    assert set(statuses) == {200} and len(statuses) == 64
    assert len(dropped) == 16 and len(finished) == 48
    deadline = time.monotonic() + 20
    while (allm.num_requests or not allm.counts.idle) and time.monotonic() < deadline:
        time.sleep(0.02)
    after = _samples(srv)
    for replica in ("0", "1", "total"):
        assert _metric(after, "polyrunner:num_requests_running", replica=replica) == 0
        assert _metric(after, "polyrunner:num_requests_waiting", replica=replica) == 0
    done = {r: _metric(after, "polyrunner:request_success_total", replica=r)
            - _metric(before, "polyrunner:request_success_total", replica=r) for r in ("0", "1", "total")}
    assert done["total"] == 64 and done["0"] + done["1"] == 64 and min(done["0"], done["1"]) >= 16, done
    aborted = (_metric(after, "polyrunner:request_success_total", replica="total", finished_reason="abort")
               - _metric(before, "polyrunner:request_success_total", replica="total", finished_reason="abort"))
    assert aborted >= 8, after   # the disconnects reached their replicas (not run to their 480 tokens)
    assert all(s.alive and s.counts.idle for s in allm.replica_states())


def test_replicas_split_the_cores_like_tensor_parallel_ranks(allm):
    from polyrunner.backends.cpu.threads import rank_cpus, usable_cpus
    for state in allm.replica_states():
        want = rank_cpus(state.index, 2) or usable_cpus()   # [] : fewer cores than replicas, all share
        assert sorted(os.sched_getaffinity(state.pid)) == want


def test_abort_reaches_the_owning_replica(allm):
    """One long request on each replica, each left after 2 outputs: each replica aborts its own."""
    seen = []
    listener = lambda stats: seen.extend((stats.replica, t.finish_reason) for t in stats.finished)  # noqa: E731
    allm.add_stats_listener(listener)

    async def leave_early(i: int) -> int | None:
        n, owner = 0, None
        async for _ in allm.generate(_prompt(200 + i), _greedy(480), request_id=f"leave-{i}"):
            n, owner = n + 1, allm._core.owner(f"leave-{i}")
            if n == 2:
                break
        return owner

    async def main():
        return await asyncio.gather(leave_early(0), leave_early(1))

    try:
        owners = asyncio.run(main())
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        allm.remove_stats_listener(listener)
    assert sorted(owners) == [0, 1]
    assert sorted(seen) == [(0, "abort"), (1, "abort")]


def test_killing_one_replica_fails_only_its_requests(srv, allm):
    async def run(i: int):
        last = None
        async for out in allm.generate(_prompt(100 + i), _greedy(480), request_id=f"long-{i}"):
            last = out
        return last

    async def main():
        tasks = [asyncio.create_task(run(i)) for i in range(4)]
        while min(s.num_running for s in allm.replica_states()) < 2:
            await asyncio.sleep(0.005)
        owners = {f"long-{i}": allm._core.owner(f"long-{i}") for i in range(4)}
        victim = allm.replica_states()[1]
        os.kill(victim.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        return owners, victim.pid, results

    owners, pid, results = asyncio.run(main())
    assert gone(pid, 10)
    for i, result in enumerate(results):
        if owners[f"long-{i}"] == 1:
            assert isinstance(result, ReplicaDeadError), result
            assert f"data-parallel replica 1 (pid {pid}) died" in str(result)
        else:
            assert result.finished and len(result.outputs[0].token_ids) == 480
    assert sorted(owners.values()) == [0, 0, 1, 1]
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded" and [d["replica"] for d in body["dead"]] == [1]
    assert allm.is_healthy and allm.degraded
    samples = _samples(srv)
    assert _metric(samples, "polyrunner:engine_healthy", replica="1") == 0
    assert _metric(samples, "polyrunner:engine_healthy", replica="0") == 1
    # new requests go to the live replica and succeed
    out = srv.client().completions.create(model="tiny", prompt=[_prompt(3)["prompt_token_ids"]] * 4, max_tokens=5,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in out.choices] == ["length"] * 4
    assert allm.num_waiting == 0 and allm.num_running == 0


def test_adapters_load_on_every_replica(tiny_model_factory, tmp_path):
    """add_lora / list_loras / remove_lora reach both replicas: a request with the adapter gives
    one replica's tokens wherever it runs."""
    folder, hf = tiny_model_factory("llama")
    lora = LoRARequest("sql", 1, make_peft_adapter(hf, tmp_path / "sql", 8, ATTENTION, seed=1))
    engine = dict(ARGS, enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128)
    prompts = [_prompt(i) for i in range(4)]
    ref = LLM(str(folder), **engine).generate(prompts, _greedy(), use_tqdm=False, lora_request=lora)
    a = AsyncLLM(str(folder), data_parallel_size=2, **engine)

    async def main():
        assert await a.add_lora(lora) is True and await a.list_loras() == {1}
        outs = []
        for p in prompts:   # one at a time: ties go round, so both replicas serve the adapter
            outs.append([out async for out in a.generate(p, _greedy(), lora_request=lora)][-1])
        assert await a.remove_lora(1) is True and await a.list_loras() == set()
        assert await a.remove_lora(1) is False
        return outs

    try:
        seen = []
        a.add_stats_listener(lambda stats: seen.extend(stats.replica for _ in stats.finished))
        outs = asyncio.run(main())
    finally:
        a.shutdown(0)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert sorted(set(seen)) == [0, 1]
