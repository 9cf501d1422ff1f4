"""The CPU backend's "lora" override (backends/cpu/lora_module.py, lora_kernel.cpp): `base(x)` then one
C++ call per LoRA linear, against the core's `LoRALinear` (`add_lora`) within the role's tolerance.

- the role's random cases (1, 2 and 3 output slices, ranks 4/8/16 zero-padded, an empty slot, tokens
  without an adapter, a slot without tokens), float32 and bfloat16, on the native build (AVX-512F
  where the CPU has it) and the portable one (plain loops, as POLYRUNNER_CPU_SIMD=0 loads);
- edge mappings: every token -1, every token in one slot, slots outside [0, L), no token, several
  kernel passes, x rows read through a stride; ranks 8/16/32 with whole and partial 16-column
  blocks and slots of 1..300 tokens; the adapters change the result;
- the module keeps the role's attributes and reads the slots at call time; the factory keeps what
  the kernel does not take; registered only with LoRA enabled, for float32 and bfloat16;
- a CPU graph records the call and its replay reads token_lora and the adapters as they are then;
- the "lora_embedding" override (`pr_lora_embed`): the role's cases, edge mappings and ids, ranks up
  to 64, registered with "lora", recorded and replayed in a CPU graph after the embedding lookup.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.lora_module import (
    CPULoRAEmbedding,
    CPULoRALinear,
    LoRAOverride,
    chunk_tokens,
    embedding_override,
    lora_overrides,
)
from polyrunner.ops.cases import CaseSizes, compare, lora_cases, lora_embedding_cases
from polyrunner.ops.lora import LoRAEmbedding, LoRALinear, LoRAMapping, add_lora, add_lora_embedding

pytestmark = pytest.mark.skipif(kernels.paged_attention_kernel() is None,
                                reason="no CPU kernel library (no C++ compiler?)")
DTYPES = [torch.float32, torch.bfloat16]


def _avx512f() -> bool:
    try:
        return any(line.startswith("flags") and " avx512f " in f"{line} " for line in open("/proc/cpuinfo"))
    except OSError:
        return False


@pytest.fixture(params=["native", "portable"])
def lora_lib(request):
    """Each kernel build: native (the AVX-512F path where the CPU has AVX-512F) and portable."""
    lib = kernels.load_library(request.param)
    assert lib is not None
    assert lib.pr_lora_simd() == (request.param == "native" and _avx512f())
    with kernels.use_kernels(request.param) as active:
        yield active


def _lora(inp: int, slices: tuple[int, ...], dtype: torch.dtype, max_loras: int = 3, rank: int = 8,
          max_tokens: int = 64, seed: int = 0) -> LoRALinear:
    """A LoRALinear over a biased nn.Linear with every slot holding a full-rank random adapter
    (lora_b block diagonal: output slice i's rows in columns i*rank:(i+1)*rank only)."""
    gen = torch.Generator().manual_seed(seed)
    base = nn.Linear(inp, sum(slices))
    base.weight.data = torch.randn(base.weight.shape, generator=gen) * inp ** -0.5
    lora = LoRALinear(base, inp, slices, max_loras, rank, LoRAMapping(max_tokens), torch.float32, "cpu")
    lora.lora_a.data = torch.randn(lora.lora_a.shape, generator=gen) * inp ** -0.5
    blocks = torch.block_diag(*[torch.ones(width, rank) for width in slices])
    lora.lora_b.data = torch.randn(lora.lora_b.shape, generator=gen) * rank ** -0.5 * blocks
    return lora.to(dtype).requires_grad_(False)


def _check(override: nn.Module, reference: LoRALinear, x: torch.Tensor, slots: torch.Tensor) -> None:
    override.mapping.set(slots)
    reference.mapping.set(slots)
    got, want = override(x.clone()), reference(x.clone())
    ok, err, bound = compare(got, want, x.dtype)
    assert ok, f"{tuple(x.shape)} slots {slots.tolist()[:8]}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_roles_cases_match_the_reference(dtype, lora_lib):
    factory, compared = LoRAOverride(64), 0
    for case in lora_cases(dtype, torch.device("cpu"), CaseSizes(), torch.Generator().manual_seed(3)):
        override = factory(copy.deepcopy(case.module))
        assert isinstance(override, CPULoRALinear)
        for call in case.calls:
            (got,), (want,) = call.run(override), call.run(case.module)
            ok, err, bound = compare(got, want, dtype)
            assert ok, f"{call.shape} slices {override.output_slices}: max error {err:.3g} > {bound:.3g}"
            compared += 1
    assert compared == 3 * 3 * 3   # 3 size pairs x 3 slice layouts x 3 row counts


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_mappings(dtype, lora_lib):
    reference = _lora(40, (24, 8, 8), dtype, max_tokens=64)
    override = LoRAOverride(4)(copy.deepcopy(reference))   # chunks of 4 tokens: several passes
    assert isinstance(override, CPULoRALinear) and override.chunk == 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(21, 40, generator=gen).to(dtype)
    for slots in (torch.full((21,), -1), torch.full((21,), 2), torch.randint(-1, 3, (21,), generator=gen),
                  torch.tensor([5, -3, 0, 7] * 5 + [1])):   # outside [0, L): no adapter, as the reference
        _check(override, reference, x, slots.to(torch.int32))
    override.mapping.set(torch.full((21,), -1, dtype=torch.int32))
    assert torch.equal(override(x), reference.base(x))       # no adapter: the base output exactly
    wide = torch.randn(9, 56, generator=gen).to(dtype)
    _check(override, reference, wide[:, 16:], torch.randint(-1, 3, (9,), generator=gen).to(torch.int32))
    assert override(x[:0]).shape == (0, 40)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16, 32])
def test_ranks_block_widths_and_tokens_per_slot(dtype, rank, lora_lib):
    """Ranks below, at and above the expand's transposed block (16 x 16), slices of whole and
    partial 16-column blocks, and slots with 1..5 tokens (groups of 4 and the rest) or with more
    tokens than one pass of the expand (256)."""
    reference = _lora(48, (40, 16, 24), dtype, max_loras=2, rank=rank, max_tokens=300, seed=rank)
    override = LoRAOverride(300)(copy.deepcopy(reference))
    assert isinstance(override, CPULoRALinear) and override.chunk == 300
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(300, 48, generator=gen).to(dtype)
    many = torch.randint(-1, 2, (300,), generator=gen)
    many[torch.randperm(300, generator=gen)[:270]] = 1
    _check(override, reference, x, many.to(torch.int32))
    for slots in ([0, 1, 0, 0, 0, 0, -1], [1], [0, 1, 1, -1, 1, 1, 1]):
        _check(override, reference, x[:len(slots)], torch.tensor(slots, dtype=torch.int32))


def test_the_adapters_change_the_result(lora_lib):
    lora = _lora(32, (48,), torch.float32)
    override = LoRAOverride(64)(lora)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    lora.mapping.set(torch.tensor([0, 1, 2, 0, 1, 2], dtype=torch.int32))
    with_adapters = override(x)
    lora.mapping.set(torch.tensor([1, 2, 0, 1, 2, 0], dtype=torch.int32))
    assert not compare(override(x), with_adapters, torch.float32)[0]
    lora.mapping.set(torch.full((6,), -1, dtype=torch.int32))
    assert not compare(override(x), with_adapters, torch.float32)[0]


def test_keeps_the_role_attributes_and_reads_the_slots_at_call_time(lora_lib):
    lora = _lora(32, (16, 16), torch.bfloat16)
    override = LoRAOverride(64)(lora)
    assert isinstance(override, CPULoRALinear)
    for name in ("base", "lora_a", "lora_b", "mapping", "output_slices", "max_rank", "in_features"):
        assert getattr(override, name) is getattr(lora, name), name
    assert override.max_loras == lora.max_loras == 3
    assert {id(p) for p in override.parameters()} == {id(p) for p in lora.parameters()}
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    lora.mapping.set(torch.tensor([0, 1, -1, 2, 1], dtype=torch.int32))
    lora.lora_b.data[1].mul_(-3.0)     # an adapter written into slot 1 after the override was made
    lora.lora_a.data[2].zero_()        # slot 2 emptied
    ok, err, bound = compare(override(x), lora(x), torch.bfloat16)
    assert ok, f"max error {err:.3g} > {bound:.3g}"


def test_the_factory_keeps_what_the_kernel_does_not_take(lora_lib):
    factory = LoRAOverride(64)
    half = _lora(32, (16,), torch.float16)
    assert factory(half) is half
    linear = nn.Linear(8, 8)
    assert factory(linear) is linear
    strided = _lora(32, (16,), torch.float32)
    strided.lora_b.data = strided.lora_b.data.transpose(1, 2).contiguous().transpose(1, 2)
    assert factory(strided) is strided
    with pytest.raises(ValueError, match="max_tokens"):
        LoRAOverride(0)
    assert chunk_tokens(64, 1, 16, 2048) == 2048 and chunk_tokens(1 << 22, 1, 16, 64) == 1
    assert 1 < chunk_tokens(4096, 3, 16, 2048) < 2048   # the scratch budget splits a long prefill


def test_registered_with_lora_enabled_for_float32_and_bfloat16():
    from polyrunner.backends.cpu.op_overrides import cpu_op_overrides
    from polyrunner.config import LoRAConfig
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=8),
                             runner=SimpleNamespace(enforce_eager=True, token_buckets=None),
                             parallel=SimpleNamespace(tensor_parallel_size=1), lora=None)
    assert "lora" not in cpu_op_overrides(config, torch.bfloat16) and lora_overrides(config, torch.float32) == {}
    config.lora = LoRAConfig(max_loras=2)
    for dtype in DTYPES:
        factory = cpu_op_overrides(config, dtype)["lora"]
        assert isinstance(factory, LoRAOverride) and factory.max_tokens == 256
        assert cpu_op_overrides(config, dtype)["lora_embedding"] is embedding_override
    assert cpu_op_overrides(config, torch.float16) == {}


class _NormBase(nn.Module):
    """A base with a linear's call [T, H] -> [T, H] that a CPU graph replays (the fused RMSNorm kernel)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(hidden, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
                                   + 0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, 1e-6)


def test_a_cpu_graph_records_the_call_and_replays_it_with_new_slots():
    from polyrunner.backends.cpu.graphs import CPUGraphAPI
    api = CPUGraphAPI(kernels.paged_attention_kernel())
    hidden = 64
    lora = LoRALinear(_NormBase(hidden), hidden, (hidden,), 3, 16, LoRAMapping(8), torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(5)
    lora.lora_a.data.copy_(torch.randn(lora.lora_a.shape, generator=gen) * hidden ** -0.5)
    lora.lora_b.data.copy_(torch.randn(lora.lora_b.shape, generator=gen) * 0.25)
    override = LoRAOverride(8)(lora)
    assert isinstance(override, CPULoRALinear)
    x = torch.randn(4, hidden, generator=gen).to(torch.bfloat16)
    lora.mapping.set(torch.tensor([0, 1, 2, -1], dtype=torch.int32))
    replay, out = api.capture(lambda: override(x), api.pool())
    assert len(replay.records) == 2   # the base's kernel, then pr_lora
    for slots in ([2, 2, -1, 0], [1, -1, 1, 1], [-1, -1, -1, -1]):
        x.copy_(torch.randn(4, hidden, generator=gen).to(torch.bfloat16))
        lora.mapping.set(torch.tensor(slots, dtype=torch.int32))   # the graph input, written in place
        lora.lora_b.data[slots[0] if slots[0] >= 0 else 0].mul_(1.5)   # an adapter rewritten in its slot
        replay()
        assert torch.equal(out, override(x))
        ok, err, bound = compare(out, add_lora(lora.base(x), x, lora.lora_a, lora.lora_b, lora.mapping.token_lora[:4]),
                                 torch.bfloat16)
        assert ok, f"slots {slots}: max error {err:.3g} > {bound:.3g}"


# ---- the "lora_embedding" override ------------------------------------------------------
def _embedding(vocab: int, hidden: int, dtype: torch.dtype, max_loras: int = 3, rank: int = 8,
               seed: int = 0) -> LoRAEmbedding:
    gen = torch.Generator().manual_seed(seed)
    emb = LoRAEmbedding(vocab, hidden, max_loras, rank, LoRAMapping(512), torch.float32, "cpu")
    emb.lora_a.data = torch.randn(emb.lora_a.shape, generator=gen)
    emb.lora_b.data = torch.randn(emb.lora_b.shape, generator=gen) * rank ** -0.5
    return emb.to(dtype).requires_grad_(False)


def _check_embedding(override: nn.Module, reference: LoRAEmbedding, ids: torch.Tensor, x: torch.Tensor,
                     slots: torch.Tensor) -> None:
    reference.mapping.set(slots)
    got, want = override(ids, x.clone()), reference(ids, x.clone())
    ok, err, bound = compare(got, want, x.dtype)
    assert ok, f"{tuple(x.shape)} slots {slots.tolist()[:8]}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_embedding_roles_cases_match_the_reference(dtype, lora_lib):
    compared = 0
    for case in lora_embedding_cases(dtype, torch.device("cpu"), CaseSizes(), torch.Generator().manual_seed(4)):
        override = embedding_override(copy.deepcopy(case.module))
        assert isinstance(override, CPULoRAEmbedding)
        for call in case.calls:
            (got,), (want,) = call.run(override), call.run(case.module)
            ok, err, bound = compare(got, want, dtype)
            assert ok, f"{call.shape}: max error {err:.3g} > {bound:.3g}"
            compared += 1
    assert compared == 3 * 3   # 3 hidden sizes x 3 row counts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_embedding_edges(dtype, rank, lora_lib):
    reference = _embedding(50, 36, dtype, rank=rank)
    override = embedding_override(reference)
    assert isinstance(override, CPULoRAEmbedding) and override.lora_a is reference.lora_a
    gen = torch.Generator().manual_seed(2)
    for tokens in (1, 5, 6, 7, 13, 300):
        ids = torch.randint(0, 50, (tokens,), generator=gen)
        x = torch.randn(tokens, 36, generator=gen).to(dtype)
        for slots in (torch.full((tokens,), -1), torch.full((tokens,), 1),
                      torch.randint(-1, 3, (tokens,), generator=gen),
                      torch.tensor([5, -3, 0, 7] * tokens)[:tokens]):   # outside [0, L): no adapter
            _check_embedding(override, reference, ids, x, slots.to(torch.int32))
    x = torch.randn(4, 36, generator=gen).to(dtype)
    reference.mapping.set(torch.full((4,), -1, dtype=torch.int32))
    assert torch.equal(override(torch.arange(4), x.clone()), x)   # no adapter: the embeddings exactly
    wide = torch.randn(4, 50, generator=gen).to(dtype)   # rows read and written through a stride
    reference.mapping.set(torch.tensor([0, 1, 2, -1], dtype=torch.int32))
    want = add_lora_embedding(wide[:, 7:43].clone(), torch.arange(4), reference.lora_a, reference.lora_b,
                              reference.mapping.token_lora[:4])
    got = override(torch.arange(4), wide[:, 7:43])
    assert compare(got, want, dtype)[0] and torch.equal(wide[:, 7:43], got)


def test_the_embedding_override_keeps_what_the_kernel_does_not_take(lora_lib):
    emb = _embedding(20, 16, torch.float16)
    assert embedding_override(emb) is emb
    override = embedding_override(_embedding(20, 16, torch.float32))
    override.mapping.set(torch.tensor([0, 2], dtype=torch.int32))
    ids, x = torch.tensor([3, 19], dtype=torch.int32), torch.randn(2, 16)   # int32 ids: the reference
    want = add_lora_embedding(x, ids, override.lora_a, override.lora_b, override.mapping.token_lora[:2])
    assert torch.equal(override(ids, x), want)


def test_a_cpu_graph_replays_the_embedding_call_with_new_slots_and_ids():
    from polyrunner.backends.cpu.graphs import CPUGraphAPI
    api = CPUGraphAPI(kernels.paged_attention_kernel())
    table = nn.Embedding(30, 32).to(torch.bfloat16).requires_grad_(False)
    emb = _embedding(30, 32, torch.bfloat16, rank=16, seed=3)
    override = embedding_override(emb)
    ids = torch.tensor([1, 2, 3, 4])
    emb.mapping.set(torch.tensor([0, 1, 2, -1], dtype=torch.int32))
    replay, out = api.capture(lambda: override(ids, table(ids)), api.pool())
    assert len(replay.records) == 2   # the lookup (a row gather), then pr_lora_embed
    gen = torch.Generator().manual_seed(6)
    for slots in ([2, 2, -1, 0], [1, -1, 1, 1], [-1, -1, -1, -1]):
        ids.copy_(torch.randint(0, 30, (4,), generator=gen))
        emb.mapping.set(torch.tensor(slots, dtype=torch.int32))
        emb.lora_b.data[max(slots[0], 0)].mul_(1.5)
        replay()
        want = add_lora_embedding(table(ids), ids, emb.lora_a, emb.lora_b, emb.mapping.token_lora[:4])
        ok, err, bound = compare(out, want, torch.bfloat16)
        assert ok, f"slots {slots}: max error {err:.3g} > {bound:.3g}"
