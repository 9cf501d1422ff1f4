"""One process's place in a tensor-parallel group, and the collectives the
engine uses, over torch.distributed.

The device group uses the backend's communicator (`Capabilities.
distributed_backend`: gloo on CPU, nccl on CUDA, hccl on Ascend); control
messages (the step a driver sends its workers, agreements at start-up) go over
a gloo group on the host, which is the device group itself when that is gloo.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polyrunner import envs
from polyrunner.distributed.shard import TPShard

# A message up to this size is one broadcast; a longer one takes a second.
HEADER_BYTES = 64 << 10
DEFAULT_TIMEOUT_S = envs.TP_TIMEOUT_S.default   # a collective waiting this long fails (slow start-ups included)


@dataclass
class TensorParallel:
    """This rank's shard and its groups (`size` > 1)."""

    shard: TPShard
    group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    device: torch.device

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (in place; returns it)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """`[N, vocab_per_rank]` on each rank -> `[N, vocab]` everywhere (padding rows cut)."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.shard.vocab_size]

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank (others pass None)."""
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            n = len(payload)
            header[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            head = min(n, HEADER_BYTES - 8)
            header[8:8 + head] = torch.frombuffer(bytearray(payload[:head]), dtype=torch.uint8)
        dist.broadcast(header, src=0, group=self.cpu_group)
        n = int(header[:8].view(torch.int64).item())
        if n <= HEADER_BYTES - 8:
            return header[8:8 + n].numpy().tobytes()
        rest = torch.empty(n - (HEADER_BYTES - 8), dtype=torch.uint8)
        if self.rank == 0:
            rest.copy_(torch.frombuffer(bytearray(payload[HEADER_BYTES - 8:]), dtype=torch.uint8))
        dist.broadcast(rest, src=0, group=self.cpu_group)
        return header[8:].numpy().tobytes() + rest.numpy().tobytes()

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks (e.g. KV blocks every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def destroy(self, synced: bool = True) -> None:
        """Leave the group. `synced`: first wait for every rank to get here (rank 0
        hosts the rendezvous store, which must outlive the others' use of it)."""
        if not dist.is_initialized():
            return
        if synced:
            try:
                dist.barrier(group=self.cpu_group)
            except Exception:   # noqa: BLE001 - a rank died: nobody to wait for
                pass
        dist.destroy_process_group()
        # drop the groups now: a group object alive at interpreter exit still has its
        # gloo threads, which abort the process when they meet a finalizing interpreter
        self.group = self.cpu_group = None


def init_tensor_parallel(shard: TPShard, comm_backend: str, init_method: str, device: torch.device,
                         timeout_s: float | None = None) -> TensorParallel:
    """Join the group (every rank calls this with the same `init_method`)."""
    timeout = datetime.timedelta(seconds=timeout_s or envs.TP_TIMEOUT_S.get())
    dist.init_process_group(comm_backend, init_method=init_method, rank=shard.rank, world_size=shard.size,
                            timeout=timeout)
    group = dist.group.WORLD
    cpu_group = group if comm_backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TensorParallel(shard, group, cpu_group, device)
