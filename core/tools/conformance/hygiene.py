"""Resource hygiene: after a run every KV block is free and the runner holds
no request state; an aborted request frees its blocks; repeated runs do not
grow host memory (Python heap or RSS) or device memory."""

from __future__ import annotations

import gc
import os
import sys

from polyrunner.tools.conformance.context import generate
from polyrunner.tools.conformance.framework import check, expect

GC_OBJECT_GROWTH = 50
PY_BLOCK_GROWTH = 1000
RSS_GROWTH_BYTES = 48 * 1024 * 1024
DEVICE_GROWTH_BYTES = 64 * 1024 * 1024


def _idle(engine) -> list[str]:
    """What the engine still holds once no request is unfinished (finished and
    aborted requests leave the runner in the step they end: no idle step needed)."""
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


@check("hygiene")
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


@check("hygiene")
def check_no_memory_growth(ctx) -> str:
    """Repeated identical runs after a warm-up do not grow Python objects, the
    process RSS or (off-host devices) used device memory beyond small bounds."""
    from polyrunner.sampling_params import SamplingParams
    engine = ctx.engine("e2e")
    prompts = ctx.prompts()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    device = not engine.backend.memory_is_host  # host memory is covered by the RSS bound

    def run() -> None:
        generate(engine, prompts, params)
        engine.step()

    def measure() -> tuple[int, int, int | None, int]:
        gc.collect()
        engine.backend.synchronize()
        free = engine.backend.memory_info()[0] if device else 0
        return len(gc.get_objects()), sys.getallocatedblocks(), _rss(), free

    run()  # warm-up
    objs0, blocks0, rss0, free0 = measure()
    runs = ctx.settings.memory_runs
    for _ in range(runs):
        run()
    objs1, blocks1, rss1, free1 = measure()
    expect(objs1 - objs0 <= GC_OBJECT_GROWTH,
           f"{objs1 - objs0} more live Python objects after {runs} identical runs (bound {GC_OBJECT_GROWTH}): "
           "something keeps per-request or per-step state")
    expect(blocks1 - blocks0 <= PY_BLOCK_GROWTH,
           f"{blocks1 - blocks0} more allocated Python memory blocks after {runs} identical runs "
           f"(bound {PY_BLOCK_GROWTH})")
    notes = [f"objects {objs1 - objs0:+d}", f"py blocks {blocks1 - blocks0:+d}"]
    if rss0 is not None and rss1 is not None:
        expect(rss1 - rss0 <= RSS_GROWTH_BYTES,
               f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over {runs} identical runs "
               f"(bound {RSS_GROWTH_BYTES // 2**20} MiB)")
        notes.append(f"RSS {(rss1 - rss0) / 2**20:+.1f} MiB")
    if device:
        expect(free0 - free1 <= DEVICE_GROWTH_BYTES,
               f"free device memory fell by {(free0 - free1) / 2**20:.1f} MiB over {runs} identical runs")
        notes.append(f"device {(free0 - free1) / 2**20:+.1f} MiB")
    return f"over {runs} runs: " + ", ".join(notes)
