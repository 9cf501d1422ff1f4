"""distributed_executor_backend="ray" on a local Ray cluster this module starts (num_cpus=2):
tensor_parallel_size=2 gives transformers' greedy tokens and tp=1's logprobs on two
architectures; a killed worker actor fails the next call within 30 s naming its rank, actor
and node; the engine leaves a cluster it attached to running, and stops one it started; no
Ray process outlives `ray.shutdown()`.

Ray is a dev dependency: without it this module fails to import (loudly), unless
POLYRUNNER_TEST_NO_RAY=1 says it is absent on purpose."""

import os
import subprocess
import sys
import time

import psutil
import pytest

if os.environ.get("POLYRUNNER_TEST_NO_RAY") == "1":
    pytest.importorskip("ray")
import ray  # noqa: E402

from hf_oracle import hf_greedy  # noqa: E402
from polyrunner.distributed.ray_workers import RayWorkers, actor_resources, bundles, local_ranks  # noqa: E402
from test_tensor_parallel import GREEDY, PROMPTS, _llm, _run, kill_during_generate  # noqa: E402

RAY_DAEMONS = ("raylet", "gcs_server")


def _ray_daemons() -> set[int]:
    """This process's descendants that are Ray's node daemons."""
    return {p.pid for p in psutil.Process().children(recursive=True)
            if any(name in " ".join(_cmdline(p)) for name in RAY_DAEMONS)}


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _all_gone(pids: set[int], timeout: float = 20.0) -> set[int]:
    """Which of `pids` still run after up to `timeout` seconds (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module; the daemons it started."""
    assert not ray.is_initialized()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    daemons = _ray_daemons()
    assert daemons, "ray.init started no raylet/gcs_server under this process"
    yield daemons
    ray.shutdown()


def test_placement_and_local_ranks():
    assert bundles(3, None, "10.0.0.1") == [{"CPU": 1.0, "node:10.0.0.1": 0.001}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert bundles(2, "GPU", "h")[1] == {"GPU": 1.0}
    assert actor_resources(None) == {"num_cpus": 1, "num_gpus": 0, "resources": {}}
    assert actor_resources("GPU") == {"num_cpus": 0, "num_gpus": 1, "resources": {}}
    assert actor_resources("NPU") == {"num_cpus": 0, "num_gpus": 0, "resources": {"NPU": 1}}
    assert local_ranks(["a", "a", "b", "a", "b"], None, 0) == [0, 1, 0, 2, 1]   # CPU: core shares per node
    assert local_ranks(["a", "a", "b"], "GPU", 3) == [3, 0, 0]   # actors see only their own device


def test_bad_placement_strategy_names_the_variable(monkeypatch, tiny_model_factory):
    monkeypatch.setenv("POLYRUNNER_RAY_PLACEMENT", "diagonal")
    with pytest.raises(ValueError, match=r"POLYRUNNER_RAY_PLACEMENT must be one of strict_pack, pack, spread"):
        _llm(tiny_model_factory("llama")[0], 2, distributed_executor_backend="ray")
    assert not ray.is_initialized()   # refused before Ray started


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_ray_tp2_equals_tp1_and_transformers(kind, cluster, tiny_model_factory):
    folder, hf = tiny_model_factory(kind)
    llm = _llm(folder, 2, distributed_executor_backend="ray")
    try:
        assert isinstance(llm.engine.tp_driver.workers, RayWorkers)
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert ray.is_initialized()   # the engine attached to the test's cluster and left it running
    expected = _run(folder, 1)
    for prompt, g, e in zip(PROMPTS, got, expected):
        go, eo = g.outputs[0], e.outputs[0]
        assert go.token_ids == eo.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
        for gp, ep in zip(go.logprobs, eo.logprobs):
            assert gp.keys() == ep.keys()
            assert all(abs(gp[t].logprob - ep[t].logprob) < 1e-4 for t in ep)


def test_a_killed_actor_fails_the_call_naming_its_rank_and_node(cluster, tiny_model_factory):
    llm = _llm(tiny_model_factory("llama")[0], 2, distributed_executor_backend="ray")
    workers = llm.engine.tp_driver.workers
    assert isinstance(workers, RayWorkers) and set(workers.runs) == {1}
    actor = workers.actors[1]
    kill_during_generate(llm, lambda: ray.kill(actor),
                         r"rank 1 \(Ray actor [0-9a-f]+ on node \S+ \([0-9a-f]+\)\) ActorDiedError")
    assert ray.is_initialized()   # attached, not started: left running
    groups = ray.util.placement_group_table().values()
    assert groups and {g["state"] for g in groups} == {"REMOVED"}   # every engine's group was removed
    deadline = time.monotonic() + 10   # Ray frees the bundles asynchronously
    while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2.0   # both CPUs free again: no actor or bundle left


def test_shutdown_leaves_no_ray_process(cluster, tiny_model_factory):
    """The test's cluster stops with `ray.shutdown()`; an engine that started its own stops it."""
    ray.shutdown()
    assert not _all_gone(cluster)
    folder = tiny_model_factory("llama")[0]
    code = f"""
import json, os, time, psutil, ray
from polyrunner import LLM, SamplingParams
llm = LLM({str(folder)!r}, backend="cpu", dtype="float32", tensor_parallel_size=2, max_num_seqs=8,
          distributed_executor_backend="ray")
daemons = [p.pid for p in psutil.Process().children(recursive=True)
           if any(n in " ".join(p.cmdline()) for n in {RAY_DAEMONS!r})]
out = llm.generate([{{"prompt_token_ids": [1, 5, 9, 200]}}], SamplingParams(temperature=0, max_tokens=4))
llm.shutdown()
deadline = time.monotonic() + 20
def alive():
    return [p for p in daemons if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
while alive() and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps([daemons, alive(), ray.is_initialized(), out[0].outputs[0].token_ids]))
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    daemons, alive, initialized, tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert daemons and not alive and not initialized and len(tokens) == 4   # gone before the process exits


def test_the_package_imports_without_ray():
    code = ("import sys; import polyrunner, polyrunner.llm, polyrunner.distributed.launch; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
