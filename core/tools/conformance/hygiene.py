"""Resource hygiene: after a run every KV block is free and the runner holds
no request state; an aborted request frees its blocks; repeated runs do not
grow what the backend holds: live tensors (bytes per device, and their
number), the device allocator's allocated bytes, Python objects; nor the
process RSS or free device memory beyond coarse bounds.

Why tensors rather than RSS: memory freed by earlier work in the process (other
engines, other backends, other checks) is reused by the allocator, so a
backend that keeps a tensor per step can grow no RSS at all after it. The
bytes of live tensors count what is held, whatever ran before."""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass

import numpy as np

from polyrunner.tools.conformance.context import MAX_ENGINE_STEPS, generate
from polyrunner.tools.conformance.framework import ENGINE_RUNS, check, expect

GC_OBJECT_GROWTH = 50
PY_BLOCK_GROWTH = 1000
# A healthy backend holds the same tensors after each identical run: after warm-up
# their bytes and number do not move at all. The bounds only leave room for a
# lazily made small buffer; a leak of one tensor per step (~30 steps over the runs)
# or of 64 KiB per step crosses them.
TENSOR_GROWTH_BYTES = 1 << 20          # per device
TENSOR_COUNT_GROWTH = 8
ALLOCATED_GROWTH_BYTES = 2 << 20       # the device allocator's allocated bytes, where torch reports them
# Coarse backstops for memory no Python tensor holds (native allocations):
RSS_GROWTH_BYTES = 48 * 1024 * 1024
DEVICE_GROWTH_BYTES = 64 * 1024 * 1024


def _idle(engine) -> list[str]:
    """What the engine still holds once no request is unfinished, after the step that
    hands the finished (and aborted) requests' slots to the runner (a step without
    rows, when one is due)."""
    if engine.scheduler.has_finished_requests():
        engine.step()
    pool, kv, runner = engine.kv.pool, engine.kv, engine.runner
    leftovers = []
    if pool.num_free_blocks != pool.num_usable_blocks:
        leftovers.append(f"{pool.num_usable_blocks - pool.num_free_blocks} of {pool.num_usable_blocks} "
                         "KV blocks still allocated")
    if kv.blocks:
        leftovers.append(f"block tables of {sorted(kv.blocks)}")
    held = [r for r in runner.states.req_ids if r is not None]
    if held:
        leftovers.append(f"runner slots still holding {sorted(held)}")
    if engine.scheduler.requests:
        leftovers.append(f"scheduler requests {sorted(engine.scheduler.requests)}")
    return leftovers


@check("hygiene", depends_on=ENGINE_RUNS)
def check_blocks_and_states_released(ctx) -> str:
    """After a run (and after aborting requests mid-way) all KV blocks are free
    and the runner's slots and the scheduler's requests are empty."""
    from polyrunner.sampling_params import SamplingParams
    engine = ctx.engine("e2e")
    generate(engine, ctx.prompts(), SamplingParams(temperature=0.0, max_tokens=ctx.settings.max_tokens,
                                                   ignore_eos=True))
    left = _idle(engine)
    expect(not left, "after a completed run the engine still holds: " + "; ".join(left))
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=50, ignore_eos=True))
           for p in ctx.prompts()]
    for _ in range(3):
        engine.step()
    for rid in ids:
        engine.abort_request(rid)
    left = _idle(engine)
    expect(not left, "after aborting running requests the engine still holds: " + "; ".join(left))
    return f"{engine.kv.pool.num_usable_blocks} blocks free, no request state"


def _rss() -> int | None:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class LiveTensors:
    """The storages of every live tensor the garbage collector sees, by device:
    views and aliases of one storage are counted once. Compact (a few objects),
    so that holding it does not move the Python object and memory block counts."""

    bytes: dict[str, int]             # device -> bytes
    count: int                        # live tensor objects
    keys: np.ndarray                  # sorted hashes of the storages' (device, address)
    details: list[tuple[int, str, int, str]] | None = None   # (key hash, device, bytes, what), when asked for

    def describe_new(self, before: "LiveTensors", limit: int = 3) -> str:
        """The largest storages alive now but not `before`, e.g.
        '24 new storages, most bytes in: 24 x float32 (1048576,) (4.00 MiB) on cpu'."""
        old = set(before.keys.tolist())
        new = [d for d in self.details or () if d[0] not in old]
        if not new:
            return "no new storage (existing ones grew)"
        kinds: dict[tuple[str, int, str], int] = {}
        for _, dev, size, what in new:
            kinds[(dev, size, what)] = kinds.get((dev, size, what), 0) + 1
        largest = sorted(kinds.items(), key=lambda kv: -kv[0][1] * kv[1])[:limit]
        shown = "; ".join(f"{n} x {what} ({size / 2**20:.2f} MiB) on {dev}" for (dev, size, what), n in largest)
        return f"{len(new)} new storages, most bytes in: {shown}"


def live_tensors(details: bool = False) -> LiveTensors:
    """Walk the garbage collector's objects for torch tensors (parameters and
    subclasses included) and sum their storages' bytes per device."""
    import torch
    tensor_type = torch.Tensor
    per_device: dict[str, int] = {}
    seen: dict[int, None] = {}
    found = []
    count = 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), tensor_type):   # type(), not isinstance: no attribute access on the object
            continue
        count += 1
        try:
            storage = obj.untyped_storage()
            device, ptr, nbytes = storage.device, storage.data_ptr(), storage.nbytes()
            if device.type == "meta":
                continue
            key = hash((str(device), ptr) if ptr else ("no-data", id(obj)))
        except Exception:  # noqa: BLE001 - sparse, nested, functional or foreign tensors: their own bytes
            try:
                device, nbytes = obj.device, obj.numel() * obj.element_size()
            except Exception:  # noqa: BLE001
                continue
            key = hash(("tensor", id(obj)))
        if key in seen:
            continue
        seen[key] = None
        dev = str(device)
        per_device[dev] = per_device.get(dev, 0) + nbytes
        if details:
            try:
                what = f"{str(obj.dtype).removeprefix('torch.')} {tuple(obj.shape)}"
            except Exception:  # noqa: BLE001
                what = type(obj).__name__
            found.append((key, dev, nbytes, what))
    keys = np.sort(np.fromiter(seen, dtype=np.int64, count=len(seen)))
    return LiveTensors(per_device, count, keys, found if details else None)


def allocated_bytes(device) -> int | None:
    """Bytes the device allocator reports allocated on `device`, where torch's
    device-generic accelerator API reports them for it (None elsewhere, e.g. host)."""
    import torch
    acc = getattr(torch, "accelerator", None)
    try:
        if acc is None or not acc.is_available() or acc.current_accelerator().type != device.type:
            return None
        return int(acc.memory_allocated(device.index if device.index is not None else acc.current_device_index()))
    except Exception:  # noqa: BLE001 - a device without allocator statistics
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:+.1f} MiB"


@check("hygiene", depends_on=ENGINE_RUNS)
def check_no_memory_growth(ctx) -> str:
    """Repeated identical runs after a warm-up do not grow the live tensors (bytes
    per device, number), the device allocator's allocated bytes or Python objects;
    nor the process RSS or free device memory beyond coarse bounds."""
    from polyrunner.sampling_params import SamplingParams
    engine = ctx.engine("e2e")
    prompts = ctx.prompts()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    device = engine.backend.device
    off_host = not engine.backend.memory_is_host  # host memory is covered by the RSS bound

    def run() -> int:
        """One run of the prompts to completion, then an idle step; the steps it took."""
        for p in prompts:
            engine.add_request({"prompt_token_ids": p}, params)
        steps = 0
        while engine.has_unfinished_requests():
            expect(steps < MAX_ENGINE_STEPS, f"the engine did not finish {len(prompts)} requests in "
                                             f"{MAX_ENGINE_STEPS} steps")
            engine.step()
            steps += 1
        engine.step()
        return steps + 1

    def measure(details: bool):
        # The tensor walk last: what it builds is not in the Python counts.
        gc.collect()
        engine.backend.synchronize()
        objs, blocks = len(gc.get_objects()), sys.getallocatedblocks()
        free = engine.backend.memory_info()[0] if off_host else 0
        return (objs, blocks, _rss(), free, allocated_bytes(device),
                live_tensors(details))

    run()  # warm-up: a cold prefix cache
    run()  # and one more: its hits change the steps' shapes (a lazily made per-shape buffer is no leak)
    # A first walk: `untyped_storage()` gives each storage a Python object for good, made
    # now, not between the counts; and a walk's result is alive at both counts.
    tensors0 = live_tensors()
    objs0, blocks0, rss0, free0, alloc0, tensors0 = measure(False)
    runs = ctx.settings.memory_runs
    steps = sum(run() for _ in range(runs))
    objs1, blocks1, rss1, free1, alloc1, tensors1 = measure(True)
    over = f"over {runs} identical runs ({steps} steps)"
    for dev in sorted(set(tensors0.bytes) | set(tensors1.bytes)):
        grew = tensors1.bytes.get(dev, 0) - tensors0.bytes.get(dev, 0)
        expect(grew <= TENSOR_GROWTH_BYTES,
               f"live tensors on {dev} grew by {grew / 2**20:.1f} MiB {over}, {grew / max(steps, 1) / 2**20:.2f} "
               f"MiB per step (bound {TENSOR_GROWTH_BYTES / 2**20:g} MiB): something keeps per-step or "
               f"per-request tensors; {tensors1.describe_new(tensors0)}")
    expect(tensors1.count - tensors0.count <= TENSOR_COUNT_GROWTH,
           f"{tensors1.count - tensors0.count} more live tensors {over} (bound {TENSOR_COUNT_GROWTH}): something "
           f"keeps per-step or per-request tensors; {tensors1.describe_new(tensors0)}")
    if alloc0 is not None and alloc1 is not None:
        expect(alloc1 - alloc0 <= ALLOCATED_GROWTH_BYTES,
               f"the {device.type} allocator's allocated bytes grew by {(alloc1 - alloc0) / 2**20:.1f} MiB {over} "
               f"(bound {ALLOCATED_GROWTH_BYTES / 2**20:g} MiB)")
    expect(objs1 - objs0 <= GC_OBJECT_GROWTH,
           f"{objs1 - objs0} more live Python objects {over} (bound {GC_OBJECT_GROWTH}): "
           "something keeps per-request or per-step state")
    expect(blocks1 - blocks0 <= PY_BLOCK_GROWTH,
           f"{blocks1 - blocks0} more allocated Python memory blocks {over} (bound {PY_BLOCK_GROWTH})")
    notes = [", ".join(f"tensors on {d} {_mib(tensors1.bytes.get(d, 0) - tensors0.bytes.get(d, 0))}"
                       for d in sorted(set(tensors0.bytes) | set(tensors1.bytes))) or "no tensors",
             f"tensors {tensors1.count - tensors0.count:+d}", f"objects {objs1 - objs0:+d}",
             f"py blocks {blocks1 - blocks0:+d}"]
    if alloc0 is not None and alloc1 is not None:
        notes.append(f"allocated {_mib(alloc1 - alloc0)}")
    if rss0 is not None and rss1 is not None:
        expect(rss1 - rss0 <= RSS_GROWTH_BYTES,
               f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB {over} (bound {RSS_GROWTH_BYTES // 2**20} MiB)")
        notes.append(f"RSS {_mib(rss1 - rss0)}")
    if off_host:
        expect(free0 - free1 <= DEVICE_GROWTH_BYTES,
               f"free device memory fell by {(free0 - free1) / 2**20:.1f} MiB {over}")
        notes.append(f"device {_mib(free0 - free1)}")
    return f"{over}: " + ", ".join(notes)
