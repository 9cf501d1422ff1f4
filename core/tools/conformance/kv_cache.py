"""KV cache: allocation has the promised logical shape, dtype, alignment and
byte budget; writes through `slot_mapping` (via the backend's attention op)
land in the right block and offset; padded tokens write only the null block."""

from __future__ import annotations

import functools

import numpy as np
import torch

from polyrunner.attention.metadata import NULL_BLOCK
from polyrunner.tools.conformance.attention_step import HostDevice, attend, write_step
from polyrunner.tools.conformance.batches import model_inputs
from polyrunner.tools.conformance.compare import close
from polyrunner.tools.conformance.framework import ALLOCATES, PADS, check, expect, fail

ALLOC_BLOCKS = 6


def _storage_bytes(tensors: list[torch.Tensor]) -> int | None:
    """Bytes of the distinct storages behind `tensors` (None when not measurable)."""
    seen, total = set(), 0
    try:
        for t in tensors:
            s = t.untyped_storage()
            key = (s.device.type, s.data_ptr())
            if key not in seen:
                seen.add(key)
                total += s.nbytes()
    except Exception:  # noqa: BLE001 - e.g. lazy device tensors without a storage
        return None
    return total


def _check_layers(ctx, backend, spec, num_blocks: int, caches, label: str) -> None:
    expect(isinstance(caches, (list, tuple)),
           f"{label}: allocate_kv_cache returned {type(caches).__name__}, not a list")
    expect(len(caches) == spec.num_layers, f"{label}: {len(caches)} tensors for {spec.num_layers} layers")
    want = spec.layer_shape(num_blocks)
    for i, t in enumerate(caches):
        expect(isinstance(t, torch.Tensor), f"{label}: layer {i} is {type(t).__name__}, not a tensor")
        expect(tuple(t.shape) == want, f"{label}: layer {i} has logical shape {tuple(t.shape)}, "
                                       f"promised {want} = [2, num_blocks, block_size, kv_heads, head_size]")
        expect(t.dtype == spec.dtype, f"{label}: layer {i} has dtype {t.dtype}, promised {spec.dtype}")
        expect(t.device.type == backend.device.type, f"{label}: layer {i} lives on {t.device}, not {backend.device}")


@check("kv_cache")
def check_allocation_shape_dtype(ctx) -> str:
    """One tensor per layer with the logical shape and dtype, on the device, for
    every declared dtype; layers and K/V do not alias; the null block is finite."""
    backend = ctx.new_backend()
    for dtype in backend.capabilities.dtypes:
        spec = ctx.kv_spec(dtype=dtype)
        caches = backend.allocate_kv_cache(spec, ALLOC_BLOCKS)
        label = f"{str(dtype).removeprefix('torch.')}"
        _check_layers(ctx, backend, spec, ALLOC_BLOCKS, caches, label)
        for i, t in enumerate(caches):
            expect(torch.isfinite(t[:, NULL_BLOCK].float()).all().item(),
                   f"{label}: layer {i}'s null block holds non-finite values after allocation "
                   "(padded requests read it)")
        # Every logical element is its own memory: write distinct values, read them back.
        n = caches[0].numel()
        for i, t in enumerate(caches):
            t.copy_((torch.arange(n, dtype=torch.float32).reshape(t.shape) % 251 + 1000 * i).to(dtype))
        for i, t in enumerate(caches):
            want = (torch.arange(n, dtype=torch.float32).reshape(t.shape) % 251 + 1000 * i).to(dtype)
            expect(torch.equal(t.cpu(), want), f"{label}: layer {i} does not hold what was written through its "
                                               "logical view: layers, K/V or blocks share memory")
    return f"{len(backend.capabilities.dtypes)} dtype(s), shape {spec.layer_shape(ALLOC_BLOCKS)}"


@check("kv_cache")
def check_alignment(ctx) -> str:
    """Each layer's cache starts at a multiple of `kv_alignment_bytes`."""
    backend = ctx.new_backend()
    align = backend.kv_alignment_bytes
    if align == 1:
        return "kv_alignment_bytes=1 (any address)"
    spec = ctx.kv_spec()
    for blocks in (ALLOC_BLOCKS, ALLOC_BLOCKS + 3):
        for i, t in enumerate(backend.allocate_kv_cache(spec, blocks)):
            ptr = t.data_ptr()
            expect(ptr % align == 0, f"layer {i} ({blocks} blocks) starts at {ptr:#x}, "
                                     f"not a multiple of kv_alignment_bytes={align}")
    return f"aligned to {align} bytes"


@check("kv_cache", depends_on=(ALLOCATES,))
def check_budget(ctx) -> str:
    """`kv_cache_budget` honours `kv_cache_memory_bytes`; the blocks
    `Backend.num_kv_blocks(spec, budget)` buys fit the budget
    when allocated (plus at most one alignment per layer to align addresses)."""
    backend = ctx.new_backend()
    align = backend.kv_alignment_bytes
    spec = ctx.kv_spec()
    unit = max(align, spec.page_size_bytes)
    budgets = [ctx.kv_budget_bytes(8, align), ctx.kv_budget_bytes(8, align) + unit // 2 + 3,
               spec.num_layers * (3 * unit + spec.page_size_bytes - 1)]
    notes = []
    for budget in budgets:
        calls = []
        got = ctx.new_backend(kv_cache_memory_bytes=budget).kv_cache_budget(0, functools.partial(calls.append, 1))
        expect(got == budget, f"kv_cache_budget returned {got} bytes with kv_cache_memory_bytes={budget}")
        expect(len(calls) <= 1, f"kv_cache_budget ran the profile {len(calls)} times")
        n = backend.num_kv_blocks(spec, budget)
        expect(n * spec.page_size_bytes * spec.num_layers <= budget,
               f"num_kv_blocks({budget}) = {n} blocks do not fit the budget")
        if n < 2:
            continue
        caches = backend.allocate_kv_cache(spec, n)
        _check_layers(ctx, backend, spec, n, caches, f"budget {budget}")
        used = _storage_bytes(caches)
        if used is None:
            notes.append("storage size not measurable")
            continue
        slack = spec.num_layers * (align if align > 1 else 0)
        expect(used <= budget + slack, f"{n} blocks allocated {used} bytes, over the budget of {budget} "
                                       f"(+{slack} address-alignment slack)")
        notes.append(f"{n} blocks: {used}/{budget} B")
        del caches
    return "; ".join(notes)


@check("kv_cache", depends_on=(PADS, ALLOCATES))
def check_slot_mapping_writes(ctx) -> str:
    """The attention op writes each real token's K/V at slot_mapping (block, offset)
    and padded tokens write nothing outside the null block."""
    backend = ctx.new_backend()
    spec = ctx.kv_spec()
    num_blocks = 24
    caches = backend.allocate_kv_cache(spec, num_blocks)
    _check_layers(ctx, backend, spec, num_blocks, caches, "write cache")
    gen = torch.Generator().manual_seed(ctx.settings.seed)
    with backend.no_grad():
        for t in caches:  # known noise everywhere, so any stray write shows
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    before = [t.cpu().clone() for t in caches]
    batch, step = write_step(ctx, backend, num_blocks)
    T = step.num_tokens
    layer = spec.num_layers - 1
    _, k, v, _, _ = attend(ctx, backend, step, caches, layer, np.random.default_rng(1))
    after = caches[layer].cpu()
    bs = spec.block_size
    slots = step.slot_mapping[:T]
    expected = before[layer].clone()
    expected[0, slots // bs, slots % bs] = k[:T].to(spec.dtype)
    expected[1, slots // bs, slots % bs] = v[:T].to(spec.dtype)
    for kv, name in ((0, "key"), (1, "value")):
        got = after[kv, slots // bs, slots % bs]
        bad = ~(got == expected[kv, slots // bs, slots % bs]).flatten(1).all(1)
        if bad.any():
            t = int(bad.nonzero()[0])
            fail(f"token {t}'s {name} is not at slot {int(slots[t])} (block {int(slots[t]) // bs}, "
                 f"offset {int(slots[t]) % bs})")
    changed = (after != expected).flatten(3).any(-1)              # [2, num_blocks, block_size]
    changed[:, NULL_BLOCK] = False
    if changed.any():
        kv, blk, off = (int(x) for x in changed.nonzero()[0])
        owner = [r for r in range(batch.num_reqs)
                 if blk in batch.block_table.table[r, : batch.block_table.num_blocks[r]]]
        whose = f"request {owner[0]}'s" if owner else "an unused"
        fail(f"{'key' if kv == 0 else 'value'} cache changed at block {blk}, offset {off} ({whose} block), "
             f"which no real token of the step maps to: padded tokens (slot_mapping[{T}:] = NULL_SLOT) "
             "or stray writes must only touch the null block")
    for other in range(spec.num_layers - 1):
        expect(torch.equal(caches[other].cpu(), before[other]), f"attention on layer {layer} changed layer {other}")
    return f"{T} real + {len(step.slot_mapping) - T} padded tokens"


def _allocator_leaves_garbage(backend, spec, num_blocks: int) -> bool:
    """Does allocate_kv_cache hand out uninitialised memory? Allocate, fill with
    NaN, free, allocate again: a zero-filling allocator shows zeros again."""
    caches = backend.allocate_kv_cache(spec, num_blocks)
    with backend.no_grad():
        for t in caches:
            t.fill_(float("nan"))
    del caches
    again = backend.allocate_kv_cache(spec, num_blocks)
    return any(bool((t[:, NULL_BLOCK + 1:].cpu() != 0).any()) for t in again)


@check("kv_cache", depends_on=(PADS, ALLOCATES))
def check_unwritten_slots_never_leak(ctx) -> str:
    """Slots a step must not read (unwritten, stale, or past a request's length
    inside its last block) do not reach real outputs: after writing the contexts,
    every other non-null slot is poisoned (NaN when the allocator hands out
    uninitialised memory, else large finite values) and the attention output
    of the real tokens must be finite and equal the reference's."""
    from polyrunner.attention.reference import reference_paged_attention
    backend = ctx.new_backend()
    spec = ctx.kv_spec()
    num_blocks = 24
    garbage = _allocator_leaves_garbage(backend, spec, num_blocks)
    poison = float("nan") if garbage else 1.0e4
    caches = backend.allocate_kv_cache(spec, num_blocks)
    _check_layers(ctx, backend, spec, num_blocks, caches, "cache")
    batch, step = write_step(ctx, backend, num_blocks)
    setup = batch.context_batch()
    layer = 0
    with backend.no_grad():
        caches[layer][:, NULL_BLOCK + 1:] = poison
        T_s = setup.num_step_tokens
        attend(ctx, backend, setup.step(T_s, setup.num_reqs), caches, layer, np.random.default_rng(3))
    before = caches[layer].cpu().clone()
    q, k, v, out, layer_spec = attend(ctx, backend, step, caches, layer, np.random.default_rng(4))
    host = HostDevice()
    ref = reference_paged_attention(q, k, v, before, model_inputs(host, step, [before]).attn, layer_spec)
    T = step.num_tokens
    got = out.cpu()[:T]
    expect(torch.isfinite(got).all().item(),
           f"attention output of real tokens is not finite with {'NaN' if garbage else 'large'} values in "
           "slots the step must not read (e.g. past a request's length in its last block): mask or zero "
           "them before the value product" + (" (this allocator returns uninitialised memory)" if garbage else ""))
    ok, err, bound = close(got, ref[:T], spec.dtype)
    expect(ok, f"attention output of real tokens changed by {err:.3g} (> {bound:.3g}) when unread slots hold "
               "garbage: the op reads slots outside the requests' contexts")
    return f"poison={'NaN (allocator leaves memory uninitialised)' if garbage else '1e4 (allocator zero-fills)'}"
