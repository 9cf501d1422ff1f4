"""Tensor-parallel ranks 1..N-1 as Ray actors (`distributed_executor_backend="ray"`).

Rank 0 stays in the engine process, as with the multiprocessing executor, and every
rank speaks the same protocol over the same torch.distributed group (the step
broadcast of `workers.TPDriver`, the backend's communicator: gloo on CPU):

    engine process (rank 0)                        Ray actor (rank r)
    connect: Ray already initialized, else RAY_ADDRESS, else a running cluster
      (address="auto"), else start a local one
    one placement group, a bundle per rank ({backend's ray_device_key: 1}, else
      {"CPU": 1}); bundle 0 on this node (rank 0 runs here); POLYRUNNER_RAY_PLACEMENT
    actor r in bundle r: ready()          --->    validate the config, make the backend
    run() (a task the driver watches)     --->    build_tp_rank, then serve_steps
    join_tensor_parallel: tcp:// on this node's address  <-->  the rendezvous
    shutdown: the "stop" broadcast, wait for run(), kill the actors, remove the
      group, `ray.shutdown()` only if we called `ray.init()`

Faults: a killed actor's sockets close, so the driver's next collective fails and
`RayWorkers.failure()` names the rank, the actor and its node (from Ray's report of
the finished `run()`). Ray is imported here only: the package imports without it.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from polyrunner.config import EngineConfig
from polyrunner.distributed.envs import RAY_PLACEMENT
from polyrunner.distributed.workers import JOIN_TIMEOUT_S, TensorParallelError, WorkerHandles

logger = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 300.0
FAILURE_WAIT_S = 10.0   # a collective failed: how long Ray may take to report the dead actor


def import_ray() -> Any:
    """The `ray` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'polyrunner[ray]'") from exc
    return ray


def connect(ray: Any, size: int) -> bool:
    """Attach to Ray (already initialized; `RAY_ADDRESS`; a running cluster) or start a
    local cluster with at least `size` CPUs; True when this call ran `ray.init()`."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return True
    try:
        ray.init(address="auto", log_to_driver=False)
    except ConnectionError:
        ray.init(num_cpus=max(os.cpu_count() or 1, size), include_dashboard=False, log_to_driver=False)
    return True


def bundles(size: int, device_key: str | None, node_ip: str) -> list[dict[str, float]]:
    """One bundle per rank: one device (`device_key`, a Ray resource) or one CPU; the
    first also needs this node (vLLM's `node:<ip>` trick), where rank 0 runs."""
    one = {device_key or "CPU": 1.0}
    return [{**one, f"node:{node_ip}": 0.001}] + [dict(one) for _ in range(size - 1)]


def actor_resources(device_key: str | None) -> dict[str, Any]:
    """The actor options that take one bundle's device (Ray spells CPU and GPU apart)."""
    key = device_key or "CPU"
    return {"num_cpus": 1 if key == "CPU" else 0, "num_gpus": 1 if key == "GPU" else 0,
            "resources": {} if key in ("CPU", "GPU") else {key: 1}}


def local_ranks(nodes: list[str], device_key: str | None, driver_device: int) -> list[int]:
    """Each rank's `local_rank` (`nodes[r]`: rank r's node). CPU: its place among the
    ranks on its node (the core share it takes); a device: Ray shows an actor only its
    own device (index 0), and rank 0 uses the device Ray gave bundle 0."""
    if device_key is not None:
        return [driver_device] + [0] * (len(nodes) - 1)
    return [nodes[:r].count(node) for r, node in enumerate(nodes)]


class RankActor:
    """A Ray actor holding one rank (`ray.remote` applies at start: Ray is optional)."""

    def ready(self, config: dict[str, Any]) -> dict[str, Any]:
        """Validate the config and make the backend (fails fast); where this actor runs."""
        from polyrunner.plugins import create_backend
        ray = import_ray()
        create_backend(EngineConfig.model_validate(config))
        ctx = ray.get_runtime_context()
        return {"actor_id": ctx.get_actor_id(), "node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "devices": ctx.get_accelerator_ids()}

    def run(self, rank: int, size: int, local_rank: int, init_method: str, config: dict[str, Any],
            plugins: dict[str, Any], log_level: int) -> None:
        """Join the group and serve steps until the driver says stop (workers.worker_main's body).
        An error leaves the group at once, so the driver's collective fails, and is raised."""
        from polyrunner.distributed.workers import serve_steps
        from polyrunner.engine.model_setup import build_tp_rank
        from polyrunner.logging_setup import configure_logging
        from polyrunner.plugins.manager import register_runtime_plugins
        configure_logging(log_level)
        register_runtime_plugins(plugins)
        built = build_tp_rank(config, rank, size, local_rank, init_method)
        try:
            serve_steps(built.tp, built.runner)
        except BaseException:
            logger.exception("tensor-parallel rank %d failed", rank)
            built.tp.destroy(synced=False)
            raise
        built.tp.destroy()


@dataclass
class RayWorkers(WorkerHandles):
    """The driver's view of its Ray actors (`WorkerHandles`' contract: `failure`, `join`)."""

    ray: Any = None
    actors: dict[int, Any] = field(default_factory=dict)   # rank -> actor (0: bundle 0's holder, devices only)
    where: dict[int, str] = field(default_factory=dict)    # rank -> "Ray actor <id> on node <ip> (<id>)"
    runs: dict[int, Any] = field(default_factory=dict)     # rank -> ObjectRef of its run()
    placement_group: Any = None
    owns_ray: bool = False

    def failure(self, wait_s: float = FAILURE_WAIT_S) -> str | None:
        """Which rank's actor failed and how, waiting up to `wait_s` for Ray's report; None if none did."""
        if not self.runs:
            return None
        done, _ = self.ray.wait(list(self.runs.values()), num_returns=1, timeout=wait_s)
        if not done:
            return None
        rank = next(r for r, ref in self.runs.items() if ref == done[0])
        try:
            self.ray.get(done[0])
            why = "left the group"
        except Exception as exc:   # noqa: BLE001 - RayActorError (died) or RayTaskError (raised)
            why = describe(exc)
        return f"rank {rank} ({self.where.get(rank, 'Ray actor')}) {why}"

    def join(self) -> None:
        """Wait for the actors' run() (they got "stop"), then kill them, free the group
        and stop Ray if we started it."""
        ray = self.ray
        if ray is None:
            return
        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=JOIN_TIMEOUT_S)
        for actor in self.actors.values():
            ray.kill(actor)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.placement_group)
        self.actors, self.runs, self.placement_group = {}, {}, None
        if self.owns_ray:
            ray.shutdown()
        self.ray = None


def start_ray_workers(config: EngineConfig, device_key: str | None) -> tuple[RayWorkers, str, int]:
    """Place ranks 1..N-1 as actors and start them (they block in the rendezvous until
    rank 0 joins); returns the handles, the init method and rank 0's local rank."""
    ray = import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from polyrunner.plugins.manager import runtime_plugins
    size = config.parallel.tensor_parallel_size
    strategy = RAY_PLACEMENT.get().upper()   # a bad value fails before Ray starts
    workers = RayWorkers(ray=ray, owns_ray=connect(ray, size))
    try:
        node_ip = ray.util.get_node_ip_address()
        wanted = bundles(size, device_key, node_ip)
        workers.placement_group = placement_group(wanted, strategy=strategy, name=f"polyrunner-tp-{os.getpid()}")
        ready, _ = ray.wait([workers.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise TensorParallelError(
                f"tensor_parallel_size={size} needs a Ray placement group of {size} bundles {wanted[1:2] or wanted} "
                f"({RAY_PLACEMENT.name}={strategy.lower()}, the first on this node {node_ip}); not placed within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()} available")
        remote = ray.remote(RankActor)
        env = {k: v for k, v in os.environ.items() if k.startswith("POLYRUNNER_")}
        config_dict = config.model_dump()
        first = 0 if device_key is not None else 1   # bundle 0's holder tells rank 0 its device
        for rank in range(first, size):
            workers.actors[rank] = remote.options(
                runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(workers.placement_group, rank),
                **actor_resources(device_key)).remote()
        infos = ready_infos(ray, workers.actors, config_dict)
        for rank, info in infos.items():
            workers.where[rank] = (f"Ray actor {info['actor_id'][:12]} on node "
                                   f"{info['node_ip']} ({info['node_id'][:12]})")
        driver_ids = infos.get(0, {}).get("devices", {}).get(device_key or "CPU", [])
        nodes = [ray.get_runtime_context().get_node_id()] + [infos[r]["node_id"] for r in range(1, size)]
        ranks = local_ranks(nodes, device_key, int(driver_ids[0]) if driver_ids else 0)
        init_method = free_init_method(node_ip)
        plugins = runtime_plugins()
        level = logging.getLogger("polyrunner").getEffectiveLevel()
        for rank in range(1, size):
            workers.runs[rank] = workers.actors[rank].run.remote(rank, size, ranks[rank], init_method, config_dict,
                                                                  plugins, level)
    except BaseException as exc:
        why = workers.failure(0)
        workers.join()
        if isinstance(exc, TensorParallelError) or why is None:
            raise
        raise TensorParallelError(f"tensor-parallel worker failed to start: {why}") from exc
    return workers, init_method, ranks[0]


def ready_infos(ray: Any, actors: dict[int, Any], config: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each actor's `ready()`; a TensorParallelError naming the first rank that cannot start."""
    refs = {rank: actor.ready.remote(config) for rank, actor in actors.items()}
    infos = {}
    for rank, ref in refs.items():
        try:
            infos[rank] = ray.get(ref, timeout=READY_TIMEOUT_S)
        except Exception as exc:   # noqa: BLE001 - RayTaskError wraps the actor's error
            raise TensorParallelError(f"tensor-parallel worker failed to start: rank {rank}: {describe(exc)}") \
                from exc
    return infos


def describe(exc: BaseException) -> str:
    """"Type: first line" of an actor's error (a RayTaskError's `cause` is the actor's own)."""
    cause = getattr(exc, "cause", None)
    err = cause if isinstance(cause, BaseException) else exc
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


def free_init_method(node_ip: str) -> str:
    """A tcp:// rendezvous on a free port of this node's address (reachable from other nodes)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return f"tcp://{node_ip}:{s.getsockname()[1]}"
