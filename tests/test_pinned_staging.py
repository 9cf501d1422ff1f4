"""PinnedStaging (core/device/staging.py): uploads through a reused arena never change bytes a
copy in flight still reads, and the arena is allocated once per growth, not per upload.

No GPU here: a simulated device queues each copy (what the staging buffer held when the copy was
issued) and runs it only when an event recorded after it is waited for, as a stream would.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrunner.device.staging import ALIGN, PinnedStaging


class FakeStream:
    """Copies run in issue order, when an event recorded after them is synchronized (or at `drain`)."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []   # (source, at issue, out)
        self.done = 0        # copies run so far
        self.corrupted = 0   # copies whose source bytes changed between issue and run

    def copy(self, buf: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = torch.empty_like(buf)
        self.pending.append((buf, buf.clone(), out))
        return out

    def run_until(self, mark: int) -> None:
        while self.done < mark:
            src, at_issue, out = self.pending.pop(0)
            self.corrupted += not torch.equal(src, at_issue)
            out.copy_(src)
            self.done += 1

    def drain(self) -> None:
        self.run_until(self.done + len(self.pending))


class Module:
    """The device module's `Event`, over a FakeStream."""

    def __init__(self, stream: FakeStream) -> None:
        class Event:
            def record(self) -> None:
                self.mark = stream.done + len(stream.pending)

            def synchronize(self) -> None:
                stream.run_until(self.mark)
        self.Event = Event


def make(half_bytes: int = 256) -> tuple[PinnedStaging, FakeStream, list[int]]:
    stream, sizes = FakeStream(), []

    def alloc(n: int) -> torch.Tensor:
        sizes.append(n)
        return torch.empty(n, dtype=torch.uint8)
    return PinnedStaging(Module(stream), "cpu", half_bytes, alloc=alloc, copy=stream.copy), stream, sizes


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 700), st.sampled_from(["int32", "int64", "float32", "bool"])),
                min_size=1, max_size=40))
def test_uploads_arrive_intact_whatever_their_sizes(uploads):
    staging, stream, _ = make()
    rng = np.random.default_rng(0)
    sent, outs = [], []
    for n, dtype in uploads:
        host = torch.from_numpy(rng.integers(0, 2 if dtype == "bool" else 1000, n).astype(dtype))
        outs.append(staging.upload(host))
        sent.append(host.clone())
        host.fill_(7)   # the caller reuses its array at once
    stream.drain()
    assert stream.corrupted == 0
    for want, got in zip(sent, outs):
        assert torch.equal(want, got)


def test_arena_is_reused_and_grows_only_for_a_larger_upload():
    staging, stream, sizes = make(half_bytes=1024)
    for _ in range(200):   # many steps of small uploads: the two halves are reused
        staging.upload(torch.arange(40, dtype=torch.int64))
    assert staging.allocations == 1 and sizes == [1024, 1024]
    staging.upload(torch.zeros(600, dtype=torch.int32))    # 2400 bytes: grows to halves of 4096
    assert staging.allocations == 2 and staging.half_bytes == 4096
    for _ in range(200):
        staging.upload(torch.zeros(600, dtype=torch.int32))
    assert staging.allocations == 2
    stream.drain()
    assert stream.corrupted == 0


def test_offsets_are_aligned_and_empty_uploads_are_free():
    staging, stream, _ = make(half_bytes=1024)
    staging.upload(torch.zeros(3, dtype=torch.int8))
    assert staging._used == ALIGN
    out = staging.upload(torch.zeros(0, 5, dtype=torch.float32))
    assert out.shape == (0, 5) and staging._used == ALIGN and len(stream.pending) == 1


def test_without_events_the_simulation_catches_an_overwrite():
    """The checker can fail: a staging that never waits overwrites bytes still in flight."""
    staging, stream, _ = make(half_bytes=128)
    staging._next_half = lambda size: setattr(staging, "_used", 0)   # reuse at once, wait for nothing
    for i in range(4):
        staging.upload(torch.full((16,), i, dtype=torch.int32))
    stream.drain()
    assert stream.corrupted > 0


def test_no_pin_memory_call_in_the_core_or_the_cuda_backend():
    """Uploads go through PinnedStaging: no `.pin_memory()` (a pinning per call) in these sources."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    calls = [f"{p.relative_to(root)}:{i}" for folder in ("core", "backends/cuda") for p in (root / folder).rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if ".pin_memory()" in line]
    assert calls == []
