"""The token embedding and the LM head kept in GGUF blocks on the CPU (backends/cpu/quant_embedding.py,
quant_rows.cpp, quant_linear.quantize_model).

- `QuantEmbedding`'s rows equal gguf's `dequantize` of the same blocks, bit for bit, for every type
  the kernels run, in the GGUF layout and (where the default path runs it) the LM head's r8 layout,
  float32 and bfloat16; ids of any shape; an id outside the vocabulary raises IndexError; a CPU
  graph records the lookup and its replay reads the ids' current values.
- Every type of `QTYPES` as the LM head (`quantize_model` on a small model): the head replaces
  `model.lm_head` (no dense matrix left), `compute_logits` runs it, within the kernels' bound of
  the dequantised float64 product (test_cpu_quant_kernels.reference) at decode rows and equal to
  the dequantised float32 product on the dense path (more rows than `dense_above`, in slabs).
- Tied: the embedding reads its rows from the head's blocks (one tensor, the head's layout).
- A tiny Llama GGUF with a tied Q6_K embedding and Q6_K linears: greedy tokens of the quantized run
  (float32 activations) equal the dequantised float32 run's up to near-ties, at most half the
  prompts (test_cpu_quant_model's rule); measured on Zen 3 (avx2) over seeds 0-4: 2 to 4 of 8
  prompts part, at gaps up to 0.151 nats, the int8 activations' doing (the embedding rows are
  exact), so NEAR_TIE is 0.25 nats, as tests/test_gguf_moe.py's. No tensor of the
  model holds a dense `[vocab, hidden]` copy, the model's weights take no more bytes than the
  file's tensors, prompt logprobs come through the quantized head, and a LoRA adapter on the
  token embeddings still applies (same tokens as the dequantised run with it, different from
  without it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

import test_gguf  # noqa: E402 - the tiny llama writer
from polyrunner import LLM, SamplingParams  # noqa: E402
from polyrunner.backends.cpu import kernels  # noqa: E402
from polyrunner.backends.cpu import quant_linear as ql  # noqa: E402
from polyrunner.backends.cpu.kernel_calls import REPLAYABLE  # noqa: E402
from polyrunner.backends.cpu.quant_embedding import QuantEmbedding  # noqa: E402
from polyrunner.models.gguf import cache as gguf_cache  # noqa: E402
from polyrunner.models.gguf.quantized import QuantizedModel, QuantizedWeight  # noqa: E402
from quant_blocks import centered_blocks  # noqa: E402
from test_cpu_quant_kernels import reference  # noqa: E402
from test_cpu_quant_model import TINY_PROMPTS, _encode_scaled, early_divergences  # noqa: E402

pytestmark = pytest.mark.skipif(ql.library() is None, reason="no CPU kernel library (no C++ compiler?)")
QTYPES = list(ql.QTYPES)


def _dense(qtype: str, blocks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, Q[qtype]), dtype=np.float32))


def _embedding(qtype: str, blocks: np.ndarray, dtype: torch.dtype, r8: bool = False) -> QuantEmbedding:
    N, K = blocks.shape[0], _dense(qtype, blocks[:1]).shape[1]
    t = ql.repack8(qtype, torch.from_numpy(blocks), K) if r8 else torch.from_numpy(blocks)
    return QuantEmbedding(qtype, ql.QTYPES[qtype], t, N, K, dtype, r8)


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_equal_ggufs_dequantisation_in_both_layouts(qtype):
    rng = np.random.default_rng(QTYPES.index(qtype))
    N, K = 40, 512
    blocks = centered_blocks(rng, qtype, N, K)
    dense = _dense(qtype, blocks)
    ids = torch.tensor([[3, 0, 39], [17, 17, 8]])
    layouts = [False] + ([True] if ql.r8_supported(qtype, (N, K), ql.default_isa()) else [])
    for r8 in layouts:
        for dtype in (torch.float32, torch.bfloat16):
            got = _embedding(qtype, blocks, dtype, r8)(ids)
            assert got.shape == (2, 3, K) and got.dtype == dtype
            assert torch.equal(got, dense.to(dtype)[ids]), f"{qtype} r8={r8} {dtype}"


def test_an_id_outside_the_vocabulary_raises_index_error():
    emb = _embedding("Q8_0", centered_blocks(np.random.default_rng(0), "Q8_0", 16, 64), torch.float32)
    for bad in (16, -1):
        with pytest.raises(IndexError, match="out of range"):
            emb(torch.tensor([1, bad]))
    assert emb(torch.tensor([0, 15], dtype=torch.int32)).shape == (2, 64)   # int32 ids are taken too


def test_a_cpu_graph_records_the_lookup_and_replays_it():
    from polyrunner.backends.cpu.graphs import CPUGraphAPI
    api = CPUGraphAPI(kernels.paged_attention_kernel())
    blocks = centered_blocks(np.random.default_rng(1), "Q6_K", 64, 256)
    emb, dense = _embedding("Q6_K", blocks, torch.bfloat16, r8=True), _dense("Q6_K", blocks).to(torch.bfloat16)
    ids = torch.tensor([1, 2, 3])
    replay, out = api.capture(lambda: emb(ids), api.pool())
    assert [REPLAYABLE[int(r[0]) - 1] for r in replay.records] == ["pr_quant_rows"]
    for seed in (5, 6):
        ids.copy_(torch.randint(0, 64, (3,), generator=torch.Generator().manual_seed(seed)))
        replay()
        assert torch.equal(out, dense[ids])


# ---------------------------------------------------------------- the LM head, every type

class _Model(nn.Module):
    """What `quantize_model` swaps the embedding and head of: a decoder's `embed_tokens`, `lm_head`."""

    def __init__(self, vocab: int, hidden: int, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = None if tied else nn.Linear(hidden, vocab, bias=False)
        self.quantized_lm_head: nn.Module | None = None


def _quantize(qtype: str, vocab: int, hidden: int, tied: bool, seed: int = 0) -> tuple[_Model, np.ndarray]:
    blocks = centered_blocks(np.random.default_rng(seed), qtype, vocab, hidden)
    weight = QuantizedWeight(qtype, (vocab, hidden), blocks)
    model = _Model(vocab, hidden, tied)
    embedding = weight if tied else None
    n = ql.quantize_model(model, QuantizedModel(lm_head=weight, embedding=embedding))
    assert n == (2 if tied else 1)
    return model, blocks


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_type_runs_as_the_lm_head_on_both_paths(qtype):
    vocab, hidden = 200, 256
    model, blocks = _quantize(qtype, vocab, hidden, tied=False, seed=QTYPES.index(qtype))
    head = model.quantized_lm_head
    assert isinstance(head, ql.QuantLinear) and model.lm_head is head and head.qtype == qtype
    assert not list(model.lm_head.parameters())   # no dense matrix to load
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    ref, bound = reference(qtype, blocks, x)
    got = head(torch.from_numpy(x))
    assert got.dtype == torch.float32 and got.shape == (3, vocab)
    assert np.all(np.abs(got.double().numpy() - ref) <= bound + 1e-6), qtype
    many = torch.randn(head.dense_above + 1, hidden)   # the dense path: dequantised, float32 matmul
    want = many @ _dense(qtype, blocks).T
    torch.testing.assert_close(head(many), want, rtol=1e-5, atol=1e-5)


def test_the_dense_path_dequantises_in_slabs_with_the_same_result(monkeypatch):
    model, blocks = _quantize("Q6_K", 64, 256, tied=False)
    head = model.quantized_lm_head
    x = torch.randn(head.dense_above + 3, 256)
    whole = head(x)
    monkeypatch.setattr(ql, "DENSE_SLAB_BYTES", 16 * 256 * 4)   # slabs of 16 rows (2 r8 groups)
    assert torch.equal(head(x), whole)


def test_a_tied_embedding_reads_the_heads_blocks():
    model, blocks = _quantize("Q6_K", 64, 256, tied=True)
    head, emb = model.quantized_lm_head, model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and head.r8 == emb.r8 == ql.r8_supported("Q6_K", (64, 256),
                                                                                      ql.default_isa())
    assert emb.blocks is head.blocks   # one copy
    ids = torch.tensor([0, 9, 63])
    assert torch.equal(emb(ids), _dense("Q6_K", blocks)[ids])


# ---------------------------------------------------------------- a tiny model end to end

PROMPTS = TINY_PROMPTS
TOKENS = 16
NEAR_TIE = 0.25   # nats (the module docstring)
TINY = dict(backend="cpu", max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=16 << 20)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory) -> Path:
    """A tiny llama whose linears and tied embedding are Q6_K (llama.cpp's type for a tied head)."""
    path = tmp_path_factory.mktemp("tied") / "tied.gguf"
    types = {f"blk.{i}.{t}.weight": Q.Q6_K for i in range(2) for t in LINEARS}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_gguf, "_encode_tensor", _encode_scaled)
        test_gguf.write_tiny_gguf(path, types={**types, "token_embd.weight": Q.Q6_K}, tied=True, seed=0)
    return path


def _greedy(llm: LLM, lora=None):
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=5)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=lora)]
    return [o.token_ids for o in outs], [(o.token_ids, o.logprobs) for o in outs]


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each tensor once (a tied embedding is the head's),
    the rotary tables aside. Tensors, not storages: the repack cache maps every linear from one file
    whose entries start on pages (`repack_cache.ALIGN`), padding that is not a copy."""
    seen: dict[int, int] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "rotary" not in name:
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())


def test_a_tied_quantized_embedding_runs_without_a_dense_copy(tied_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "gguf")
    dense = LLM(str(tied_gguf), dtype="float32", **TINY)
    _, want = _greedy(dense)
    vocab, hidden = dense.engine.arch.vocab_size, dense.engine.arch.hidden_size
    del dense
    quant = LLM(str(tied_gguf), quantization="gguf", dtype="float32", max_num_batched_tokens=ql.PREFILL_ROWS, **TINY)
    model = quant.engine.runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.lm_head is None
    assert model.embed_tokens.blocks is model.quantized_lm_head.blocks and model.lm_head_weight() is None
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                if t.is_floating_point() and t.numel() >= vocab * hidden]
    reader = gguf.GGUFReader(str(tied_gguf))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    assert _weight_bytes(model) <= file_bytes * 1.01, (_weight_bytes(model), file_bytes)
    got, _ = _greedy(quant)
    assert all(len(a) == TOKENS for a in got)
    assert len(early_divergences(got, want, TOKENS, NEAR_TIE, PROMPTS)) <= len(PROMPTS) // 2
    out = quant.generate([PROMPTS[3]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert all(lp is not None for lp in out.prompt_logprobs[1:])   # through the quantized head


def test_a_lora_adapter_on_the_embeddings_applies_to_the_quantized_embedding(tied_gguf, tmp_path, monkeypatch):
    from polyrunner.lora.peft import LoRAWeights, save_adapter
    from polyrunner.lora.request import LoRARequest
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "gguf")
    common = dict(TINY, enable_lora=True, max_loras=1, max_lora_rank=8, dtype="float32")
    dense = LLM(str(tied_gguf), **common)
    vocab, hidden = dense.engine.arch.vocab_size, dense.engine.arch.hidden_size
    gen = torch.Generator().manual_seed(0)
    save_adapter(tmp_path / "emb", {}, 8, 8.0, LoRAWeights(torch.randn(8, vocab, generator=gen),
                                                          torch.randn(hidden, 8, generator=gen) * 0.3))
    lora = LoRARequest("emb", 1, str(tmp_path / "emb"))
    _, want = _greedy(dense, lora)
    del dense
    quant = LLM(str(tied_gguf), quantization="gguf", max_num_batched_tokens=ql.PREFILL_ROWS, **common)
    assert isinstance(quant.engine.runner.model.embed_tokens, QuantEmbedding)
    got, _ = _greedy(quant, lora)
    assert got != _greedy(quant)[0]   # the adapter changes the tokens
    assert len(early_divergences(got, want, TOKENS, NEAR_TIE, PROMPTS)) <= len(PROMPTS) // 2
