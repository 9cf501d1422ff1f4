"""Execution: the prepared executor (captured / compiled / warmed up) gives
the logits eager execution gives for the same padded batch, for every bucket
(or a bounded sample); after warm-up no new graph is compiled; the backend's
attention op agrees with the reference paged attention."""

from __future__ import annotations

import numpy as np
import torch

from polyrunner.tools.conformance.attention_step import HostDevice, attend, write_step
from polyrunner.tools.conformance.batches import make_batch, model_inputs, split_counts, with_new_tokens
from polyrunner.tools.conformance.compare import close
from polyrunner.tools.conformance.context import generate
from polyrunner.tools.conformance.framework import ENGINE_RUNS, PADS, check, expect, fail


@check("execution", requires=("counts_graphs",), depends_on=ENGINE_RUNS)
def check_no_new_graphs_after_warmup(ctx) -> str:
    """After warm-up, a stream of random batch shapes compiles no new graph."""
    from polyrunner.sampling_params import SamplingParams
    engine = ctx.engine("exec")
    executor = engine.runner.executor
    before = executor.num_graphs()
    expect(before is not None, "capabilities.counts_graphs is True but num_graphs() returned None")
    rng = np.random.default_rng(ctx.settings.seed + 11)
    s = ctx.settings
    longest = min(60, s.max_model_len - 10)
    n = s.stream_requests
    prompts = [rng.integers(3, ctx.arch.vocab_size, size=int(rng.integers(1, longest + 1))).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 9)), ignore_eos=True) for _ in range(n)]
    steps = 0
    for p, sp in zip(prompts[: n // 2], params):   # half now, half while those run
        engine.add_request({"prompt_token_ids": p}, sp)
    for _ in range(3):
        engine.step()
        steps += 1
    generate(engine, prompts[n // 2:], params[n // 2:])
    after = executor.num_graphs()
    expect(after == before, f"{after - before} new graph(s) compiled after warm-up "
                            f"({before} after prepare, {after} after {n} random requests)")
    return f"{before} graphs, unchanged over {n} random requests"


def _axis_ranges(buckets: list[int], top: int, fallback: list[int]) -> list[tuple[int, int, int]]:
    """(bucket, lo, hi): real sizes in [lo, hi] pad to `bucket`; unpadded axes use fallback sizes."""
    if not buckets:
        return [(n, n, n) for n in sorted({min(x, top) for x in fallback})]
    out, prev = [], 0
    for b in buckets:
        lo, hi = prev + 1, min(b, top)
        if lo <= hi:
            out.append((b, lo, hi))
        prev = b
    if prev < top:   # above the largest bucket (a non-static backend runs these unpadded)
        out.append((top, prev + 1, top))
    return out


def bucket_samples(policy, mnbt: int, mns: int, limit: int, rng) -> list[tuple[int, int, str]]:
    """(T, R, kind) real batch shapes: for each sampled (token, request) bucket a
    mixed batch (prefills and decodes) and, where the bucket allows T == R,
    a decode-only batch."""
    t_ranges = _axis_ranges(policy.token_buckets, mnbt, [1, 2, 3, 8, 17, mnbt])
    r_ranges = _axis_ranges(policy.request_buckets, mns, [1, 2, 3, mns])
    cells = []
    for tb, tlo, thi in t_ranges:
        for rb, rlo, rhi in r_ranges:
            if rlo > thi:
                continue
            cells.append((tb, rb, tlo, thi, rlo, rhi))
    if len(cells) > limit:
        keep = {0, len(cells) - 1} | set(
            rng.choice(np.arange(1, len(cells) - 1), size=limit - 2, replace=False).tolist())
        cells = [c for i, c in enumerate(cells) if i in keep]
    out = []
    for _tb, _rb, tlo, thi, rlo, rhi in cells:
        if thi > rlo:                       # a mixed batch: T > R
            R = int(rng.integers(rlo, min(rhi, thi - 1) + 1))
            out.append((int(rng.integers(max(tlo, R + 1), thi + 1)), R, "mixed"))
        lo, hi = max(tlo, rlo), min(thi, rhi)
        if lo <= hi:                        # a decode-only batch: T == R
            n = int(rng.integers(lo, hi + 1))
            out.append((n, n, "decode"))
    return out


@check("execution", depends_on=ENGINE_RUNS)
def check_prepared_equals_eager(ctx) -> str:
    """For every bucket (bounded sample), executor.run on the padded batch gives
    the logits of eager model execution of the same batch; twice per bucket with
    different tokens, so a replay that returns stale outputs shows."""
    engine = ctx.engine("exec")
    runner = engine.runner
    policy, executor, model = runner.buckets, runner.executor, runner.model
    s = engine.config.scheduler
    rng = np.random.default_rng(ctx.settings.seed + 3)
    mnbt, mns = s.max_num_batched_tokens, s.max_num_seqs
    samples = bucket_samples(policy, mnbt, mns, ctx.settings.max_bucket_pairs, rng)
    expect(samples, "no bucket admits a legal batch")
    top_t = policy.token_buckets[-1] if policy.token_buckets else s.max_num_batched_tokens
    dtype = engine.dtype
    worst = 0.0
    for T, R, kind in samples:
        counts = split_counts(rng, T, R, all_decode=(kind == "decode"))
        batch = make_batch(rng, counts, vocab=ctx.arch.vocab_size, block_size=runner.block_size,
                           max_model_len=runner.max_model_len, num_blocks=runner.num_blocks,
                           context_budget=min(s.max_num_batched_tokens, top_t))
        setup = batch.context_batch()
        with runner.backend.no_grad():
            if setup is not None:  # write the contexts through the prepared path
                step = setup.step(*policy.pad(setup.num_step_tokens, setup.num_reqs))
                executor.run(runner._to_device(step))
            for attempt, data in enumerate((batch, with_new_tokens(batch, rng, ctx.arch.vocab_size))):
                T_pad, R_pad = policy.pad(T, R)
                step = data.step(T_pad, R_pad)
                inputs = runner._to_device(step)
                hidden = executor.run(inputs)
                got = model.compute_logits(hidden[inputs.logits_indices[:R]]).float().cpu()
                eager_hidden = model(inputs.input_ids, inputs.positions, inputs.attn, inputs.kv_caches)
                ref = model.compute_logits(eager_hidden[inputs.logits_indices[:R]]).float().cpu()
                ok, err, bound = close(got, ref, dtype)
                if not ok:
                    fail(f"{kind} batch of {T} tokens / {R} requests padded to ({T_pad}, {R_pad}), "
                         f"{'second' if attempt else 'first'} run: prepared logits differ from eager by "
                         f"{err:.3g} (> {bound:.3g}){' -- stale replay output?' if attempt else ''}")
                worst = max(worst, err)
    shapes = sorted({policy.pad(T, R) for T, R, _ in samples})
    return f"{len(samples)} batches over {len(shapes)} padded shapes, max |diff| {worst:.2g}"


@check("execution", depends_on=(PADS, "kv_cache::slot_mapping_writes"))
def check_attention_matches_reference(ctx) -> str:
    """The backend's attention op gives the reference paged attention's output
    for the real tokens of a padded decode + prefill step."""
    return _attention_vs_reference(ctx)


@check("execution", requires=("attention:logits_soft_cap",), depends_on=(PADS, "kv_cache::slot_mapping_writes"))
def check_attention_soft_cap_matches_reference(ctx) -> str:
    """With a logit soft cap (Gemma 2) the attention op still gives the reference's output."""
    return _attention_vs_reference(ctx, logits_soft_cap=SOFT_CAP)


@check("execution", requires=("attention:sliding_window",), depends_on=(PADS, "kv_cache::slot_mapping_writes"))
def check_attention_sliding_window_matches_reference(ctx) -> str:
    """With a sliding window shorter than the contexts (and with a soft cap too, where the
    backend declares both) the attention op gives the reference's output."""
    note = _attention_vs_reference(ctx, sliding_window=ctx.kv_spec().block_size // 2 + 1)
    if "logits_soft_cap" not in ctx.new_backend().capabilities.attention_features:
        return note
    both = _attention_vs_reference(ctx, sliding_window=ctx.kv_spec().block_size // 2 + 1, logits_soft_cap=SOFT_CAP)
    return f"{note}; with soft cap {both}"


SOFT_CAP = 1.5   # below the random scores' spread (standard normal after the scale), so it changes them


def _attention_vs_reference(ctx, sliding_window: int | None = None, logits_soft_cap: float | None = None) -> str:
    from polyrunner.attention.reference import reference_paged_attention
    backend = ctx.new_backend()
    spec = ctx.kv_spec()
    num_blocks = 24
    caches = backend.allocate_kv_cache(spec, num_blocks)
    gen = torch.Generator().manual_seed(ctx.settings.seed + 5)
    with backend.no_grad():
        for t in caches:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    ref_caches = [t.cpu().clone().contiguous() for t in caches]
    _, step = write_step(ctx, backend, num_blocks)
    layer = 0
    q, k, v, out, layer_spec = attend(ctx, backend, step, caches, layer, np.random.default_rng(2), sliding_window,
                                      logits_soft_cap)
    meta = model_inputs(HostDevice(), step, ref_caches).attn
    ref = reference_paged_attention(q, k, v, ref_caches[layer], meta, layer_spec)
    T = step.num_tokens
    got = out.cpu()
    expect(tuple(got.shape) == tuple(q.shape),
           f"attention returned shape {tuple(got.shape)}, expected {tuple(q.shape)}")
    ok, err, bound = close(got[:T], ref[:T], spec.dtype)
    expect(ok, f"attention output of the {T} real tokens differs from the reference by {err:.3g} (> {bound:.3g})")
    return f"max |diff| {err:.2g}"
