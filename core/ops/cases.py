"""Random cases of the module roles and the tolerance a replacement is held to: what the
conformance suite's `ops` group compares a backend's replacement with the reference on.

A case is one reference module with random weights (norm weights away from one, biases
non-zero, so a replacement that drops either differs), in a dtype, on a device, and the
calls to compare on it, each on fresh copies of random inputs (a replacement may work in
place). Sizes: the model's own and odd ones (`CaseSizes`), row counts from 1 to a few dozen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from polyrunner.ops.gated_mlp import GatedMLP
from polyrunner.ops.lora import LoRAEmbedding, LoRALinear, LoRAMapping
from polyrunner.ops.moe import FusedMoE
from polyrunner.ops.rms_norm import RMSNorm
from polyrunner.ops.rotary import RotaryEmbedding

# max |replacement - reference| <= TOLERANCE[dtype] * max |reference|, per output: float32 is
# tight (another summation order only); a 16-bit dtype allows four units in its last place at
# the output's scale (a fused kernel rounds once where the reference rounds two or three times).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4 * 2.0 ** -10, torch.bfloat16: 4 * 2.0 ** -7}
MAX_POSITIONS = 512   # the rotary cases' tables


@dataclass(frozen=True)
class CaseSizes:
    """The sizes cases are made at: `hidden` / `intermediate` pair up for the MLP; `heads` is
    (query heads, key-value heads) for the rotary; the rms_norm also runs on `[rows, 4, head_dim]`
    (the q/k norms)."""

    rows: tuple[int, ...] = (1, 7, 37)
    hidden: tuple[int, ...] = (64, 72, 100)
    intermediate: tuple[int, ...] = (128, 100, 36)
    head_dims: tuple[int, ...] = (16, 64)
    heads: tuple[int, int] = (4, 2)


@dataclass(frozen=True)
class Call:
    """One call of a case's module: `run(module)` returns its outputs, named by `outputs`."""

    method: str    # "forward" or "forward_add"
    shape: str     # the main input's shape, e.g. "7x64"
    run: Callable[[nn.Module], tuple[torch.Tensor, ...]]
    outputs: tuple[str, ...] = ("output",)


@dataclass(frozen=True)
class Case:
    module: nn.Module          # the reference, random weights, in the case's dtype and device
    calls: tuple[Call, ...]


CaseMaker = Callable[[torch.dtype, torch.device, CaseSizes, torch.Generator], Iterator[Case]]


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])


def compare(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[bool, float, float]:
    """(agree, max |got - ref|, the bound): another shape or dtype, or a non-finite value, never agrees."""
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False, float("inf"), 0.0
    g, r = got.detach().float().cpu(), ref.detach().float().cpu()
    bound = tolerance(dtype) * (float(r.abs().max()) if r.numel() else 0.0)
    err = float((g - r).abs().max()) if r.numel() else 0.0
    return bool(torch.isfinite(g).all()) and err <= bound, err, bound


def _ready(module: nn.Module, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Parameters in `dtype` (buffers, e.g. the rotary tables, stay float32 as in a loaded model), on `device`."""
    for p in module.parameters():
        p.data = p.data.to(dtype)
    return module.to(device).eval().requires_grad_(False)


def _randn(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype, device: torch.device,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _random_linear(lin: nn.Linear, gen: torch.Generator) -> None:
    lin.weight.data = torch.randn(lin.weight.shape, generator=gen) * lin.in_features ** -0.5
    if lin.bias is not None:
        lin.bias.data = torch.randn(lin.bias.shape, generator=gen) * 0.5


def _shape(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape))


def linear_cases(dtype: torch.dtype, device: torch.device, sizes: CaseSizes, gen: torch.Generator) -> Iterator[Case]:
    """`nn.Linear(h, 2h)` without a bias and `nn.Linear(h, h + 8)` with one, for each hidden size."""
    for h in sizes.hidden:
        for out, bias in ((2 * h, False), (h + 8, True)):
            lin = nn.Linear(h, out, bias=bias)
            _random_linear(lin, gen)
            xs = [_randn((rows, h), gen, dtype, device) for rows in sizes.rows]
            yield Case(_ready(lin, dtype, device), tuple(
                Call("forward", _shape(x), lambda m, x=x: (m(x.clone()),)) for x in xs))


def rms_norm_cases(dtype: torch.dtype, device: torch.device, sizes: CaseSizes, gen: torch.Generator
                   ) -> Iterator[Case]:
    """RMSNorm over each hidden size (`[rows, h]`) and head dim (`[rows, 4, d]`), weights 1 +- 0.3:
    `forward` and `forward_add`."""
    for inner in [(h,) for h in sizes.hidden] + [(4, d) for d in sizes.head_dims]:
        norm = RMSNorm(inner[-1], 1e-5)
        norm.weight.data = torch.randn(inner[-1], generator=gen) * 0.3 + 1.0
        calls = []
        for rows in sizes.rows:
            x, r = _randn((rows, *inner), gen, dtype, device, 3.0), _randn((rows, *inner), gen, dtype, device, 3.0)
            calls.append(Call("forward", _shape(x), lambda m, x=x: (m(x.clone()),)))
            calls.append(Call("forward_add", _shape(x), lambda m, x=x, r=r: tuple(m.forward_add(x.clone(), r.clone())),
                              ("norm", "residual")))
        yield Case(_ready(norm, dtype, device), tuple(calls))


def gated_mlp_cases(dtype: torch.dtype, device: torch.device, sizes: CaseSizes, gen: torch.Generator
                    ) -> Iterator[Case]:
    """GatedMLP(hidden, intermediate) for each pair of sizes, with a bias every other one."""
    for i, (h, inter) in enumerate(zip(sizes.hidden, sizes.intermediate)):
        mlp = GatedMLP(h, inter, bias=bool(i % 2))
        _random_linear(mlp.gate_up_proj, gen)
        _random_linear(mlp.down_proj, gen)
        xs = [_randn((rows, h), gen, dtype, device) for rows in sizes.rows]
        yield Case(_ready(mlp, dtype, device), tuple(
            Call("forward", _shape(x), lambda m, x=x: (m(x.clone()),)) for x in xs))


def rotary_cases(dtype: torch.dtype, device: torch.device, sizes: CaseSizes, gen: torch.Generator) -> Iterator[Case]:
    """RotaryEmbedding for each head dim, at random positions; q and k are views of one fused
    qkv row, as the model's projection makes them (q [T, Hq, D], k [T, Hkv, D])."""
    hq, hkv = sizes.heads
    for i, d in enumerate(sizes.head_dims):
        rotary = RotaryEmbedding(d, MAX_POSITIONS, 10000.0 if i % 2 == 0 else 1e6, None)
        calls = []
        for rows in sizes.rows:
            qkv = _randn((rows, (hq + 2 * hkv) * d), gen, dtype, device)
            positions = torch.randint(0, MAX_POSITIONS, (rows,), generator=gen).to(device)

            def run(m: nn.Module, qkv: torch.Tensor = qkv, positions: torch.Tensor = positions,
                    d: int = d) -> tuple[torch.Tensor, ...]:
                fresh = qkv.clone()
                q = fresh[:, :hq * d].view(-1, hq, d)
                k = fresh[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
                return tuple(m(positions, q, k))
            calls.append(Call("forward", f"{rows}x{hq}x{d}", run, ("q", "k")))
        yield Case(_ready(rotary, dtype, device), tuple(calls))


def moe_cases(dtype: torch.dtype, device: torch.device, sizes: CaseSizes, gen: torch.Generator) -> Iterator[Case]:
    """FusedMoE over each (hidden, intermediate) pair: 8 experts, top-2, softmax renormalised,
    with the last expert's logits far below the rest (it receives no token); 4 experts, top-4
    (every token routed to every expert), sigmoid scoring without renormalisation."""
    settings = ((8, 2, True, "softmax"), (4, 4, False, "sigmoid"))
    for h, inter in zip(sizes.hidden, sizes.intermediate):
        for experts, top_k, renormalize, scoring in settings:
            moe = FusedMoE(experts, top_k, h, inter, renormalize, scoring)
            moe.w13_weight.data = torch.randn(moe.w13_weight.shape, generator=gen) * h ** -0.5
            moe.w2_weight.data = torch.randn(moe.w2_weight.shape, generator=gen) * inter ** -0.5
            calls = []
            for rows in sizes.rows:
                x = _randn((rows, h), gen, dtype, device)
                logits = torch.randn((rows, experts), generator=gen) * 2.0
                if top_k < experts:
                    logits[:, -1] = -30.0   # an expert that receives no token
                logits = logits.to(device=device, dtype=dtype)
                calls.append(Call("forward", _shape(x), lambda m, x=x, g=logits: (m(x.clone(), g.clone()),)))
            yield Case(_ready(moe, dtype, device), tuple(calls))


LORA_MAX_LORAS, LORA_MAX_RANK = 3, 16
LORA_RANKS = (4, 8, 16, 0)   # the adapters' ranks, rotated over the slots per case (0: an empty slot)


def _lora_slices(h: int, inter: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(in, output_slices) of a down_proj, a gate_up_proj and a qkv_proj at these sizes."""
    return (inter, (h,)), (h, (inter, inter)), (h, (h, h // 4, h // 4))


def _lora_weights(lora: LoRALinear, case: int, gen: torch.Generator) -> None:
    """Slot l holds an adapter of rank `LORA_RANKS[(case + l) % 4]`, zero-padded to max_rank in
    each output slice's block (the first slot's adapter skips the last slice of a fused linear:
    a target module it does not have); B scaled like a folded lora_alpha / r."""
    slots, ranks, inp = lora.lora_a.shape
    out, big_r = lora.lora_b.shape[1], lora.max_rank
    a, b = torch.zeros(slots, ranks, inp), torch.zeros(slots, out, ranks)
    start = 0
    for s, width in enumerate(lora.output_slices):
        for slot in range(slots):
            r = LORA_RANKS[(case + slot) % len(LORA_RANKS)]
            untargeted = slot == 0 and len(lora.output_slices) > 1 and s == len(lora.output_slices) - 1
            if r == 0 or untargeted:
                continue
            a[slot, s * big_r:s * big_r + r] = torch.randn(r, inp, generator=gen) * inp ** -0.5
            b[slot, start:start + width, s * big_r:s * big_r + r] = torch.randn(width, r, generator=gen) * r ** -0.5
        start += width
    lora.lora_a.data, lora.lora_b.data = a, b


def _token_lora(rows: int, slots: int, idle: int, gen: torch.Generator) -> torch.Tensor:
    """Random slots in [-1, slots) for `rows` tokens, never `idle` (a slot that receives no token)."""
    pick = torch.randint(0, slots, (rows,), generator=gen)   # 0 -> -1, others -> a slot != idle
    choices = torch.tensor([-1] + [s for s in range(slots) if s != idle])
    return choices[pick].to(torch.int32)


def lora_cases(dtype: torch.dtype, device: torch.device, sizes: CaseSizes, gen: torch.Generator) -> Iterator[Case]:
    """LoRALinear (an `nn.Linear` base, with a bias every other case) over each (hidden,
    intermediate) pair with 1, 2 and 3 output slices (down_proj, gate_up_proj, qkv_proj shapes):
    3 slots of max rank 16 holding adapters of ranks 4, 8 and 16 or an empty slot (`_lora_weights`);
    per row count a random `token_lora` with tokens without an adapter (-1) and a slot that
    receives no token, written into the module's mapping before its call."""
    case = 0
    for h, inter in zip(sizes.hidden, sizes.intermediate):
        for inp, slices in _lora_slices(h, inter):
            base = nn.Linear(inp, sum(slices), bias=bool(case % 2))
            _random_linear(base, gen)
            mapping = LoRAMapping(max(sizes.rows), device)
            lora = LoRALinear(base, inp, slices, LORA_MAX_LORAS, LORA_MAX_RANK, mapping, torch.float32, "cpu")
            _lora_weights(lora, case, gen)
            calls = []
            for i, rows in enumerate(sizes.rows):
                x = _randn((rows, inp), gen, dtype, device)
                slots = _token_lora(rows, LORA_MAX_LORAS, (case + i) % LORA_MAX_LORAS, gen).to(device)

                def run(m: nn.Module, x: torch.Tensor = x, slots: torch.Tensor = slots) -> tuple[torch.Tensor, ...]:
                    mapping = m.mapping   # the module's own (a replacement keeps it)
                    assert isinstance(mapping, LoRAMapping)
                    mapping.set(slots)
                    return (m(x.clone()),)
                calls.append(Call("forward", _shape(x), run))
            yield Case(_ready(lora, dtype, device), tuple(calls))
            case += 1


LORA_VOCAB = 97   # the embedding cases' vocabulary


def lora_embedding_cases(dtype: torch.dtype, device: torch.device, sizes: CaseSizes, gen: torch.Generator
                         ) -> Iterator[Case]:
    """LoRAEmbedding at each hidden size: 3 slots of max rank 16 holding adapters of ranks 4, 8
    and 16 or an empty slot (rotated per case); per row count random token ids (the first and last
    of the vocabulary among them), a random `token_lora` as for "lora" and random embeddings."""
    for case, h in enumerate(sizes.hidden):
        mapping = LoRAMapping(max(sizes.rows), device)
        emb = LoRAEmbedding(LORA_VOCAB, h, LORA_MAX_LORAS, LORA_MAX_RANK, mapping, torch.float32, "cpu")
        for slot in range(LORA_MAX_LORAS):
            r = LORA_RANKS[(case + slot) % len(LORA_RANKS)]
            emb.lora_a.data[slot, :, :r] = torch.randn(LORA_VOCAB, r, generator=gen)
            emb.lora_b.data[slot, :, :r] = torch.randn(h, r, generator=gen) * (2 / max(r, 1)) * 0.1
        calls = []
        for i, rows in enumerate(sizes.rows):
            ids = torch.randint(0, LORA_VOCAB, (rows,), generator=gen)
            ids[0], ids[-1] = 0, LORA_VOCAB - 1
            ids = ids.to(device)
            x = _randn((rows, h), gen, dtype, device)
            slots = _token_lora(rows, LORA_MAX_LORAS, (case + i) % LORA_MAX_LORAS, gen).to(device)

            def run(m: nn.Module, ids: torch.Tensor = ids, x: torch.Tensor = x,
                    slots: torch.Tensor = slots) -> tuple[torch.Tensor, ...]:
                mapping = m.mapping
                assert isinstance(mapping, LoRAMapping)
                mapping.set(slots)
                return (m(ids, x.clone()),)
            calls.append(Call("forward", _shape(x), run))
        yield Case(_ready(emb, dtype, device), tuple(calls))
