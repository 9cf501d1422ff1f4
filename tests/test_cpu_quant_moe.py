"""The "moe" role over experts kept in GGUF blocks on the CPU (backends/cpu/moe_module.py's
`QuantFusedMoE`, moe_experts.cpp's `pr_moe_quant`, swapped in by quant_linear.quantize_model).

- The kernel equals its definition: per routed pair, the expert's gate_up and down through the
  quantized linear (`quant_matmul`, the same int8 activations), silu(gate) * up between, summed by
  the routing weights; every GGUF type the kernels run (as gate/up or down), both weight layouts
  (GGUF, r8 where it keeps the bytes), every compiled instruction-set path, float32 and bfloat16,
  several kernel passes, and the edge routings (no token, an expert without tokens, top_k == E,
  sigmoid scores, no renormalisation).
- The role's contract: within the int8 activations' error of `FusedMoE` on the dequantised weights.
- Layouts: the module's blocks take exactly the file's bytes (every r8 copy keeps them; the scalar
  path's stacks are the file's blocks themselves); no dense parameter.
- A CPU graph records the one call per layer and its replay recomputes from the current inputs.
- A tiny Q4_K_M-shaped Mixtral GGUF (tests/quant_moe_gguf.py: Q4_K gate/up stacks, Q6_K / Q4_K down
  stacks, Q4_K embedding, Q6_K head) runs with quantized experts in every layer; its weights take
  no more than 1.15 x the file's tensor bytes, the experts exactly theirs, and no float tensor
  holds an expert stack or the embedding. (Its attn_v is Q4_K, not llama.cpp's Q6_K: a fused qkv
  of parts of two types stays dense, `quantized.py` stacks parts of one type only.)
- Greedy tokens (float32 activations) against the dequantised float32 run, on such a Mixtral whose
  tokens use every expert (top_k == E): a prompt's tokens may part only where the dequantised
  run's top two are within NEAR_TIE (0.25 nats, as tests/test_gguf_moe.py's), and until then each
  chosen token's logprob stays within NEAR_TIE of the dequantised run's. With top-2 of 8 the
  int8 activations also flip routing choices, whole experts apart (measured: partings at gaps
  of 1-3 nats and beyond the top 5 in the dequantised run, with the experts dense and only the
  attention quantized as well): every expert used keeps the output continuous in the weights.
  Measured on Zen 3 (avx2), seeds 0-3: 2 to 5 of 8 prompts part within 16 tokens (a random tiny
  model's flat distributions), at gaps up to 0.083 nats; logprobs move by at most 0.16 nats.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from polyrunner import LLM, SamplingParams  # noqa: E402
from polyrunner.backends.cpu import kernels, repack_cache  # noqa: E402
from polyrunner.backends.cpu import quant_linear as ql  # noqa: E402
from polyrunner.backends.cpu.kernel_calls import REPLAYABLE  # noqa: E402
from polyrunner.backends.cpu.moe_module import QuantFusedMoE, QuantMoEScratch  # noqa: E402
from polyrunner.backends.cpu.quant_embedding import QuantEmbedding  # noqa: E402
from polyrunner.models.gguf import cache as gguf_cache  # noqa: E402
from polyrunner.models.gguf.blocks import QuantizedWeight  # noqa: E402
from polyrunner.models.gguf.moe import QuantizedExperts  # noqa: E402
from polyrunner.ops import FusedMoE  # noqa: E402
from polyrunner.ops.moe import select_experts  # noqa: E402
from quant_blocks import scaled_blocks  # noqa: E402
from quant_moe_gguf import MoEShape, write_quant_moe_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(ql.library() is None, reason="no CPU kernel library (no C++ compiler?)")
# gate/up type, down type: every type of QTYPES at least once in each place
PAIRS = [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("Q4_0", "Q5_K"), ("IQ4_XS", "Q2_K"), ("Q5_0", "Q3_K"),
         ("Q4_1", "Q5_1"), ("IQ4_NL", "Q4_K"), ("Q6_K", "IQ4_NL"), ("Q5_K", "IQ4_XS"), ("Q2_K", "Q4_0"),
         ("Q3_K", "Q4_1"), ("Q5_1", "Q5_0")]
ISAS = [isa for isa in ql.ISAS if ql.isa_unavailable_reason(isa) is None]
# (kernel build, path): the backend's build on each path it has, and the VNNI paths it lacks through the
# "vnni_emulated" build (`vpdpbusd` emulated in AVX2, kernels.VARIANTS) where the CPU has AVX2
PATHS = [(None, isa) for isa in ISAS] + [("vnni_emulated", isa) for isa in ("avxvnni", "avx512vnni")
                                         if isa not in ISAS and "avx2" in ISAS]
NEAR_TIE = 0.25   # nats


def _deq(qtype: str, blocks: np.ndarray) -> torch.Tensor:
    E, N, _ = blocks.shape
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks.reshape(E * N, -1), Q[qtype]),
                                       dtype=np.float32)).reshape(E, N, -1)


def _experts(qt13: str, qt2: str, experts: int = 8, top_k: int = 2, hidden: int = 256, inter: int = 256,
             renormalize: bool = True, scoring: str = "softmax", isa: str | None = None, chunk: int = 16,
             seed: int = 0) -> tuple[QuantFusedMoE, FusedMoE, QuantizedExperts]:
    """(the quantized module, `FusedMoE` on the same values dequantised, the blocks)."""
    rng = np.random.default_rng(seed)
    gate, up = (scaled_blocks(rng, qt13, experts * inter, hidden, hidden ** -0.5) for _ in range(2))
    down = scaled_blocks(rng, qt2, experts * hidden, inter, inter ** -0.5)
    ref = FusedMoE(experts, top_k, hidden, inter, renormalize, scoring)
    stacked = [b.reshape(experts, rows, -1) for b, rows in ((gate, inter), (up, inter), (down, hidden))]
    ref.w13_weight.data = torch.cat([_deq(qt13, stacked[0]), _deq(qt13, stacked[1])], dim=1)
    ref.w2_weight.data = _deq(qt2, stacked[2])
    blocks = QuantizedExperts(QuantizedWeight(qt13, (experts * inter, hidden), gate),
                              QuantizedWeight(qt13, (experts * inter, hidden), up),
                              QuantizedWeight(qt2, (experts * hidden, inter), down), experts, ())
    module = ql._experts(ref, blocks, isa or ql.default_isa(), QuantMoEScratch(chunk))
    assert isinstance(module, QuantFusedMoE)
    return module, ref, blocks


def _composed(module: QuantFusedMoE, blocks: QuantizedExperts, x: torch.Tensor, logits: torch.Tensor,
              isa: str) -> torch.Tensor:
    """The kernel's definition, one routed pair at a time through `quant_matmul` (float64 sums)."""
    weights, ids = select_experts(logits, module.top_k, module.renormalize, module.scoring)
    hidden, num = module.hidden, module.num_experts

    def linear(w: QuantizedWeight, e: int, x: torch.Tensor) -> torch.Tensor:
        rows = torch.from_numpy(w.blocks).view(num, w.shape[0] // num, -1)[e]
        return ql.quant_matmul(w.qtype, rows, w.shape[1], x, torch.float32, isa)

    out = torch.zeros(x.shape[0], hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(module.top_k):
            e = int(ids[t, j])
            g, u = linear(blocks.gate, e, x[t:t + 1].float()), linear(blocks.up, e, x[t:t + 1].float())
            y = linear(blocks.down, e, (g / (1 + torch.exp(-g)) * u).contiguous())
            out[t] += float(weights[t, j]) * y[0].double()
    return out


def _inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=gen).to(dtype), (torch.randn(tokens, experts, generator=gen) * 2)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Float32 sums in another order, and a rare int8 rounding of an activation at a half step
    (exp() differs by an ulp), well below a wrong block, scale or expert (whole units)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    tol = (1e-3 if dtype == torch.float32 else 1e-2) * scale + 1e-6
    err = float((got.double() - want).abs().max()) if want.numel() else 0.0
    assert err <= tol, f"max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("variant,isa", PATHS)
@pytest.mark.parametrize("qt13,qt2", PAIRS)
def test_the_kernel_is_its_experts_through_the_quantized_linears(qt13, qt2, variant, isa):
    with kernels.use_kernels(variant) if variant else contextlib.nullcontext():
        if variant and ql.isa_unavailable_reason(isa) is not None:
            pytest.skip(f"{variant} build, {isa}: {ql.isa_unavailable_reason(isa)}")
        module, _, blocks = _experts(qt13, qt2, isa=isa, seed=PAIRS.index((qt13, qt2)))
        assert module.r8 == tuple(ql.r8_supported(q, s, isa) for q, s in ((qt13, (512, 256)), (qt2, (256, 256))))
        for tokens in (1, 7, 40):   # 40: three passes of 16
            for dtype in (torch.float32, torch.bfloat16):
                x, logits = _inputs(tokens, 256, 8, dtype, seed=tokens)
                got = module(x, logits.to(dtype))
                assert got.shape == (tokens, 256) and got.dtype == dtype
                _check(got, _composed(module, blocks, x, logits.to(dtype).float(), isa), dtype)


@pytest.mark.parametrize("qt13,qt2", PAIRS[:4])
def test_the_roles_contract_within_the_int8_activations_error(qt13, qt2):
    """Two products with int8 activations: ~1% of the output's norm (measured 1.0-1.3%)."""
    module, ref, _ = _experts(qt13, qt2, seed=11)
    x, logits = _inputs(17, 256, 8, torch.float32)
    want, got = ref(x, logits), module(x, logits)
    assert float((got - want).norm() / want.norm()) < 0.03


EDGES = {   # experts, top_k, tokens, renormalize, scoring, an expert no token picks
    "no_tokens": (8, 2, 0, True, "softmax", None),
    "an_expert_without_tokens": (8, 2, 20, True, "softmax", 3),
    "top_k_is_E": (4, 4, 9, False, "sigmoid", None),
    "sigmoid_renormalised": (6, 3, 17, True, "sigmoid", None),
    "softmax_not_renormalised": (6, 1, 17, False, "softmax", None),
}


@pytest.mark.parametrize("edge", list(EDGES))
def test_edge_routings(edge):
    experts, top_k, tokens, renormalize, scoring, idle = EDGES[edge]
    module, _, blocks = _experts("Q8_0", "Q4_1", experts, top_k, 64, 64, renormalize, scoring, chunk=8)
    x, logits = _inputs(tokens, 64, experts, torch.float32)
    if idle is not None:
        logits[:, idle] = -30.0
    _check(module(x, logits), _composed(module, blocks, x, logits, ql.default_isa()), torch.float32)


def test_the_experts_keep_the_files_bytes_and_no_dense_weight():
    module, _, blocks = _experts("Q4_K", "Q6_K", isa="scalar")   # the scalar path: the GGUF layout
    assert not list(module.parameters()) and not hasattr(module, "w13_weight")
    assert [b.numel() for b in (module.gate_blocks, module.up_blocks, module.down_blocks)] == \
        [w.nbytes for w in (blocks.gate, blocks.up, blocks.down)]
    assert module.r8 == (False, False)
    assert module.gate_blocks.data_ptr() == blocks.gate.blocks.ctypes.data   # the blocks themselves, no copy
    r8 = _experts("Q4_K", "Q6_K")[0]   # r8 where the path runs it: a copy of the same bytes
    assert [b.numel() for b in (r8.gate_blocks, r8.up_blocks, r8.down_blocks)] == \
        [w.nbytes for w in (blocks.gate, blocks.up, blocks.down)]
    for name in ("num_experts", "top_k", "intermediate", "renormalize", "scoring"):
        assert hasattr(module, name)


def test_what_the_kernel_refuses_is_named():
    module, _, _ = _experts("Q8_0", "Q8_0", hidden=64, inter=64)
    module.top_k = 9
    with pytest.raises(RuntimeError, match="code 1"):
        module(*_inputs(2, 64, 8, torch.float32))
    gate = QuantizedWeight("F16", (8 * 64, 64), np.zeros((8 * 64, 128), np.uint8))
    down = QuantizedWeight("Q8_0", (8 * 64, 64), np.zeros((8 * 64, 68), np.uint8))
    blocks = QuantizedExperts(gate, gate, down, 8, ())
    assert ql._experts(FusedMoE(8, 2, 64, 64), blocks, ql.default_isa(), QuantMoEScratch()) is None


def test_inputs_of_other_dtypes_and_strides_are_made_rows():
    module, _, _ = _experts("Q8_0", "Q8_0", hidden=64, inter=64)
    x, logits = _inputs(5, 64, 8, torch.float32)
    want = module(x, logits)
    assert torch.equal(module(x.to(torch.float64), logits.to(torch.float16)).float(), module(x, logits.half().float()))
    wide = torch.zeros(5, 128)
    wide[:, ::2] = x
    assert torch.equal(module(wide[:, ::2], logits), want)


def test_a_cpu_graph_records_the_call_and_replays_it():
    from polyrunner.backends.cpu.graphs import CPUGraphAPI
    api = CPUGraphAPI(kernels.paged_attention_kernel())
    module, _, _ = _experts("Q4_K", "Q6_K")
    x, logits = _inputs(3, 256, 8, torch.bfloat16)
    logits = logits.to(torch.bfloat16)
    replay, out = api.capture(lambda: module(x, logits), api.pool())
    assert [REPLAYABLE[int(r[0]) - 1] for r in replay.records] == ["pr_moe_quant"]
    for seed in (5, 6):
        new_x, new_logits = _inputs(3, 256, 8, torch.bfloat16, seed)
        x.copy_(new_x)
        logits.copy_(new_logits)
        replay()
        assert torch.equal(out, module(x, logits))


# ---------------------------------------------------------------- a tiny Q4_K_M Mixtral end to end

PROMPTS = [np.random.default_rng(s).integers(3, 512, size=n).tolist() for s, n in enumerate([5, 17, 33, 58, 9, 41,
                                                                                              12, 26])]
TOKENS = 16
TINY = dict(backend="cpu", max_num_seqs=8, max_model_len=128, kv_cache_memory_bytes=16 << 20, dtype="float32")


def _greedy(llm: LLM):
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


def test_a_q4_k_m_mixtral_runs_with_quantized_experts(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "gguf")
    monkeypatch.setattr(repack_cache, "cache_dir", lambda: tmp_path / "repack")
    shape = MoEShape()
    shape.types["attn_v"] = shape.types["attn"]   # one fused quantized qkv (the module docstring)
    path = write_quant_moe_gguf(tmp_path / "moe.gguf", shape)
    llm = LLM(str(path), quantization="gguf", max_num_batched_tokens=ql.PREFILL_ROWS, **TINY)
    model = llm.engine.runner.model
    moe = [layer.mlp.experts for layer in model.layers]
    assert all(isinstance(m, QuantFusedMoE) for m in moe)
    assert [m.qtypes for m in moe] == [("Q4_K", "Q6_K"), ("Q4_K", "Q4_K")]
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.lm_head is model.quantized_lm_head
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    experts = sum(n for name, n in tensors.items() if "_exps." in name)
    assert sum(b.numel() for m in moe for b in m.buffers()) == experts
    weights = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for name, t in [*model.named_parameters(), *model.named_buffers()] if "rotary" not in name}
    assert sum(weights.values()) <= 1.15 * sum(tensors.values())
    largest = min(shape.experts * shape.intermediate * shape.hidden, shape.vocab * shape.hidden)
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                if t.is_floating_point() and t.numel() >= largest]
    assert all(len(o.token_ids) == TOKENS for o in _greedy(llm))
    # the r8 stacks are views of the repack cache's mapped file, not copies made at load
    r8 = [b for m in moe for b, on in ((m.gate_blocks, m.r8[0]), (m.up_blocks, m.r8[0]), (m.down_blocks, m.r8[1]))
          if on]
    files = list((tmp_path / "repack").glob("*/*.blocks"))
    assert r8 or not ql.uses_r8("Q4_K", (shape.intermediate, shape.hidden))
    assert len(files) == 1 and all(b.untyped_storage().nbytes() == files[0].stat().st_size for b in r8)


def test_greedy_tokens_equal_the_dequantised_runs_up_to_near_ties(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "gguf")
    shape = MoEShape(experts=4, top_k=4)   # every expert used: no routing flips (the module docstring)
    shape.types["attn_v"] = shape.types["attn"]
    path = write_quant_moe_gguf(tmp_path / "moe.gguf", shape)
    want = _greedy(LLM(str(path), **TINY))
    llm = LLM(str(path), quantization="gguf", max_num_batched_tokens=ql.PREFILL_ROWS, **TINY)
    assert isinstance(llm.engine.runner.model.layers[0].mlp.experts, QuantFusedMoE)
    for prompt, a, b in zip(PROMPTS, _greedy(llm), want):
        assert len(a.token_ids) == TOKENS
        for i, (p, q) in enumerate(zip(a.token_ids, b.token_ids)):
            top = b.logprobs[i]
            if p != q:
                gap = top[q].logprob - top[p].logprob if p in top else math.inf
                assert gap < NEAR_TIE, f"prompt of {len(prompt)}: token {i} is {p}, dequantised {q} by {gap:.3f}"
                break
            moved = abs(a.logprobs[i][p].logprob - top[q].logprob)
            assert moved < NEAR_TIE, f"prompt of {len(prompt)}: token {i}'s logprob moved by {moved:.3f} nats"
