"""Padding buckets: every legal batch maps to a bucket that covers it, the
lists are sorted and unique and end at the configured maximum, and padding
stays within the policy's own `max_padding` bound.

Legal batches for a scheduler config (after the backend's `Backend.adjust_config`,
where a static-shape backend caps max_num_seqs at its largest request bucket):
T <= max_num_batched_tokens tokens over R <= min(max_num_seqs, T) requests. A
non-static backend may leave a batch above its largest bucket unpadded (pad
returns it unchanged).
"""

from __future__ import annotations

import numpy as np

from polyrunner.tools.conformance.framework import PADS, check, expect, fail

MAX_PAIRS = 40_000  # all pairs up to this many, a dense sample above


def _policies(ctx):
    """(label, scheduler limits, policy) for each configured (max_num_seqs, max_num_batched_tokens)."""
    if "bucket_policies" not in ctx.cache:
        out = []
        for mns, mnbt in ctx.settings.bucket_configs:
            backend = ctx.new_backend(max_num_seqs=mns, max_num_batched_tokens=mnbt)
            cfg, policy = backend.config, backend.bucket_policy()
            out.append((f"max_num_seqs={mns}, max_num_batched_tokens={mnbt}",
                        cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens, policy))
        ctx.cache["bucket_policies"] = out
    return ctx.cache["bucket_policies"]


def legal_pairs(mnbt: int, mns: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Every (T, R) with R <= min(mns, T), or a dense sample (all small T, all edges, random rest)."""
    total = sum(min(mns, t) for t in range(1, mnbt + 1))
    if total <= MAX_PAIRS:
        return [(t, r) for t in range(1, mnbt + 1) for r in range(1, min(mns, t) + 1)]
    pairs = {(t, r) for t in range(1, min(mnbt, 64) + 1) for r in range(1, min(mns, t) + 1)}
    for t in range(1, mnbt + 1):
        pairs |= {(t, 1), (t, min(mns, t))}
    ts = rng.integers(1, mnbt + 1, size=MAX_PAIRS)
    pairs |= {(int(t), int(rng.integers(1, min(mns, t) + 1))) for t in ts}
    return sorted(pairs)


@check("buckets")
def check_lists_sorted_unique(ctx) -> str:
    """Token and request bucket lists are sorted, unique, >= 1."""
    for label, _, _, p in _policies(ctx):
        for axis in ("token_buckets", "request_buckets"):
            b = list(getattr(p, axis))
            expect(all(isinstance(x, (int, np.integer)) for x in b), f"[{label}] {axis} has non-integers: {b}")
            expect(b == sorted(set(b)), f"[{label}] {axis} is not sorted and unique: {b}")
            expect(all(x >= 1 for x in b), f"[{label}] {axis} has a bucket < 1: {b}")
    return "; ".join(f"{len(p.token_buckets)}x{len(p.request_buckets)}" for *_, p in _policies(ctx)) + " buckets"


@check("buckets", depends_on=("buckets::lists_sorted_unique",))
def check_end_at_configured_maximum(ctx) -> str:
    """Non-empty lists end at the configured maximum: no bucket beyond the first
    that covers it, and a static-shape backend covers max_num_batched_tokens."""
    static = ctx.capabilities.static_shapes
    for label, mns, mnbt, p in _policies(ctx):
        for axis, b, top in (("token", p.token_buckets, mnbt), ("request", p.request_buckets, mns)):
            if not b:
                continue
            above = [x for x in b if x >= top]
            expect(len(above) <= 1, f"[{label}] {axis} buckets {b} continue past the first bucket covering "
                                    f"the maximum {top}: {above[1:]} can never be used")
        if static:
            expect(p.token_buckets and p.token_buckets[-1] >= mnbt,
                   f"[{label}] static-shape backend: the largest token bucket "
                   f"{p.token_buckets[-1] if p.token_buckets else None} does not cover "
                   f"max_num_batched_tokens={mnbt}")
    return "ok"


def _pad_all(ctx, label, mns, mnbt, p, visit) -> int:
    pairs = legal_pairs(mnbt, mns, np.random.default_rng(ctx.settings.seed))
    for T, R in pairs:
        try:
            got = p.pad(T, R)
        except Exception as exc:  # noqa: BLE001
            fail(f"[{label}] pad({T}, {R}) raised {type(exc).__name__}: {exc}")
        expect(isinstance(got, tuple) and len(got) == 2, f"[{label}] pad({T}, {R}) returned {got!r}")
        visit(T, R, int(got[0]), int(got[1]))
    return len(pairs)


@check("buckets", depends_on=("buckets::end_at_configured_maximum",))
def check_pad_covers_every_legal_batch(ctx) -> str:
    """pad(T, R) >= (T, R) for every legal pair, and lands on a bucket (static
    backends always; others either a bucket or unpadded)."""
    static = ctx.capabilities.static_shapes
    n = 0
    for label, mns, mnbt, p in _policies(ctx):
        tb, rb = set(p.token_buckets), set(p.request_buckets)

        def visit(T, R, Tp, Rp, label=label, tb=tb, rb=rb):   # (bound now: called within this pass)
            expect(Tp >= T, f"[{label}] pad({T}, {R}) = ({Tp}, {Rp}): token bucket {Tp} < {T} tokens")
            expect(Rp >= R, f"[{label}] pad({T}, {R}) = ({Tp}, {Rp}): request bucket {Rp} < {R} requests")
            for axis, got, real, buckets in (("token", Tp, T, tb), ("request", Rp, R, rb)):
                if buckets and got not in buckets and (static or got != real):
                    fail(f"[{label}] pad({T}, {R}) = ({Tp}, {Rp}): {axis} size {got} is not a bucket "
                         f"{'(a static-shape backend must always pad to one)' if static else 'and not unpadded'}")

        n += _pad_all(ctx, label, mns, mnbt, p, visit)
    return f"{n} legal (tokens, requests) pairs"


@check("buckets", depends_on=(PADS,))
def check_padding_within_bound(ctx) -> str:
    """Padding never exceeds the policy's own `max_padding` bound."""
    worst = 0
    for label, mns, mnbt, p in _policies(ctx):
        def visit(T, R, Tp, Rp, label=label, p=p):   # (bound now: called within this pass)
            nonlocal worst
            for axis, got, real in (("tokens", Tp, T), ("requests", Rp, R)):
                bound = p.max_padding(real, axis)
                expect(got - real <= bound, f"[{label}] pad({T}, {R}) adds {got - real} {axis}, more than "
                                            f"max_padding({real}, {axis!r}) = {bound}")
            worst = max(worst, Tp - T)

        _pad_all(ctx, label, mns, mnbt, p, visit)
    return f"largest token padding seen: {worst}"


@check("buckets", depends_on=(PADS,))
def check_pad_monotonic_and_stable(ctx) -> str:
    """More tokens or requests never pad smaller, and a padded shape pads to itself
    (so warmed-up shapes are the shapes served)."""
    for label, mns, mnbt, p in _policies(ctx):
        seen: dict[tuple[int, int], tuple[int, int]] = {}
        _pad_all(ctx, label, mns, mnbt, p, lambda T, R, Tp, Rp, seen=seen: seen.__setitem__((T, R), (Tp, Rp)))
        for (T, R), (Tp, Rp) in seen.items():
            for nxt in ((T + 1, R), (T, R + 1)):
                if nxt in seen:
                    expect(seen[nxt][0] >= Tp and seen[nxt][1] >= Rp,
                           f"[{label}] not monotonic: pad{(T, R)} = {(Tp, Rp)} but pad{nxt} = {seen[nxt]}")
            if Rp <= Tp and (Tp in p.token_buckets or not p.token_buckets):
                again = tuple(int(x) for x in p.pad(Tp, Rp))
                expect(again == (Tp, Rp), f"[{label}] pad({Tp}, {Rp}) = {again}: a padded shape must pad to itself")
    return "ok"
