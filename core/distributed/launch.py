"""Start the tensor-parallel group from the engine (rank 0).

- One host (default): rank 0 spawns ranks 1..N-1 (`torch.multiprocessing`'s
  spawn start method) and they meet at a tcp:// rendezvous on a free loopback port.
- Several hosts: start every rank with `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR, MASTER_PORT; env:// rendezvous) running the same program. On rank
  0 `LLM(...)` returns as usual; on the others it serves steps until rank 0 shuts
  down and then exits the process (the program's code after `LLM(...)` runs on
  rank 0 only).
- Ray (`distributed_executor_backend="ray"`): ranks 1..N-1 are Ray actors in one
  placement group, on this node or across a cluster's (`ray_workers.py`).
"""

from __future__ import annotations

import os

from polyrunner.config import EngineConfig
from polyrunner.distributed.workers import TPDriver, WorkerHandles, free_tcp_init_method, start_workers, worker_main
from polyrunner.engine.model_setup import join_tensor_parallel


def start_tensor_parallel(config: EngineConfig, backend) -> TPDriver | None:
    """Rank 0's driver (None when tensor_parallel_size is 1, or the backend shards by SPMD)."""
    size = config.parallel.tensor_parallel_size
    if size == 1 or backend.capabilities.spmd:
        return None
    if config.parallel.distributed_executor_backend == "ray":   # ranks 1..N-1 as Ray actors
        from polyrunner.distributed.ray_workers import start_ray_workers
        actors, ray_init_method, local_rank = start_ray_workers(config, backend.capabilities.ray_device_key)
        try:
            tp = join_tensor_parallel(config, backend, 0, local_rank, ray_init_method)
        except BaseException:
            actors.join()
            raise
        return TPDriver(tp, actors)
    config_dict = config.model_dump()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:   # started by torchrun
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if world != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} processes; "
                             "they must be equal")
        if rank != 0:
            worker_main(rank, size, local_rank, "env://", config_dict, None)
            raise SystemExit(0)
        return TPDriver(join_tensor_parallel(config, backend, 0, local_rank, "env://"), WorkerHandles())
    init_method = free_tcp_init_method()
    workers = start_workers(size, init_method, config_dict)
    try:
        tp = join_tensor_parallel(config, backend, 0, 0, init_method)
    except BaseException:
        workers.join()
        raise
    return TPDriver(tp, workers)
