"""Tensor parallelism on XLA through SPMD: one process, one program, weights annotated.

`torch_xla.distributed.spmd` partitions one traced program over a device mesh; the model code
is the single-device one and XLA inserts the collectives. The annotations follow the Megatron
split the core's ranks use (`polyrunner.distributed.shard`):

- column-parallel `qkv_proj`, `gate_up_proj` (and MoE-free dense MLPs): output rows split;
- row-parallel `o_proj`, `down_proj`: input columns split (XLA all-reduces the partial sums);
- vocabulary-parallel `embed_tokens`, `lm_head`: rows split;
- the KV cache: split by KV head when the heads divide, else replicated;
- everything else (norms, biases) replicated.

The fused `qkv_proj` / `gate_up_proj` rows are split as stored, not per head: GSPMD keeps the
result exact (it reshards where the split does not line up with the heads), at the price of
collectives a head-aligned layout would avoid. On the CPU PJRT device, `CPU_NUM_DEVICES=N`
gives N virtual devices (torch_xla 2.9; XLA_FLAGS=--xla_force_host_platform_device_count is
not honoured). `xr.use_spmd()` must run before this process makes any XLA tensor.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

AXIS = "model"
COLUMN = ("qkv_proj.weight", "gate_up_proj.weight", "embed_tokens.weight", "lm_head.weight")
ROW = ("o_proj.weight", "down_proj.weight")


def enable(size: int) -> None:
    """Turn SPMD on for `size` devices; refuses with the device count when they differ."""
    import torch_xla.runtime as xr
    xr.use_spmd()   # first: counting the devices starts the runtime client, which must start in SPMD mode
    count = xr.global_runtime_device_count()
    if count != size:
        raise ValueError(f"tensor_parallel_size={size}: the XLA device has {count} devices and SPMD shards over "
                         f"all of them; allowed: {count} (on the CPU PJRT device set CPU_NUM_DEVICES={size})")
    logger.info("xla: SPMD tensor parallelism over %d devices", size)


def mesh(size: int):
    import torch_xla.distributed.spmd as xs
    return xs.Mesh(np.arange(size), (size,), (AXIS,))


def partition_spec(name: str, dim: int) -> tuple[str | None, ...] | None:
    """The sharding of parameter `name` (None: replicated)."""
    if dim == 2 and name.endswith(COLUMN):
        return (AXIS, None)
    if dim == 2 and name.endswith(ROW):
        return (None, AXIS)
    return None


def shard_model(model: torch.nn.Module, size: int) -> int:
    """Annotate the model's weights (Megatron split); returns how many were sharded."""
    import torch_xla.distributed.spmd as xs
    m, n = mesh(size), 0
    for name, p in model.named_parameters():
        spec = partition_spec(name, p.dim())
        if spec is not None and p.shape[spec.index(AXIS)] % size == 0:
            xs.mark_sharding(p, m, spec)
            n += 1
    return n


def shard_kv_cache(cache: torch.Tensor, head_dim: int, size: int) -> None:
    """Split one layer's cache by KV head (dimension `head_dim`) when the heads divide."""
    import torch_xla.distributed.spmd as xs
    if cache.shape[head_dim] % size:
        return
    spec: list[str | None] = [None] * cache.dim()
    spec[head_dim] = AXIS
    xs.mark_sharding(cache, mesh(size), tuple(spec))
