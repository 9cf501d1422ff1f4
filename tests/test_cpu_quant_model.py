"""The embedded SmolLM2 Q4_1 GGUF run quantized on the CPU backend, against the
same file dequantised to float32 (the path checked against transformers in test_gguf.py).

- Greedy, 8 prompts x 64 tokens, quantized with float32 activations
  (`quantization="gguf", dtype="float32"`) and by default (bfloat16
  activations): the first 16 tokens of each prompt equal float32's, except
  where float32 itself is at a near-tie (its top two tokens within NEAR_TIE
  nats: int8 activations, like llama.cpp's, may pick either, and a 1e-7
  change of summation order already flips some; vLLM's `check_logprobs_close`
  accepts such a divergence the same way); at most half the prompts may end
  early that way. Measured: 1 to 3 of 8 end early, at gaps of 0.04-0.2 nats;
  the dequantised bfloat16 path (the GGUF default before) ends 3 of 8 early.
  The int8 activations make the quantized run sensitive to float32 summation
  order elsewhere: on a Zen 4 VM the portable kernel build (`POLYRUNNER_CPU_SIMD=0`,
  whose float32 dense tokens equal the native build's) ends 4 of 8 early, at
  0.13-0.32 nats, the native build 1 of 8 at 0.04.
- Perplexity of a fixed public-domain text (tests/data/) within 2%. Prompt
  logprobs come from the model's own `compute_logits` (the dense LM head), so
  this checks every quantized linear; the quantized LM head (Q8_0) is checked
  by the greedy tokens, which go through it. Measured: 16.302 (float32),
  16.258 (quantized, float32 activations), 16.300 (quantized default).
- The quantized engines step at most `PREFILL_ROWS` tokens at a time
  (`max_num_batched_tokens`), so every step, prefill included, runs the
  integer kernels (larger steps dequantise, which would equal float32 here).
- The forced AVX2 path (`POLYRUNNER_CPU_QUANT_ISA=avx2`) gives the same tokens
  as the default path (the same integer sums).

Tiny models, one per GGUF type the kernels run besides the embedded file's (Q6_K, Q5_K, Q5_0,
Q5_1, IQ4_NL, IQ4_XS, Q3_K, Q2_K): every linear and the LM head of test_gguf.py's tiny llama
(2 layers, hidden 256) in that type, random valid blocks (mins at the middle of the integer
range, as a quantizer sets them: `quant_blocks.centered_blocks`) whose float16 scales are set
for weights of standard deviation WEIGHT_STD. Greedy, 8 prompts x 24 tokens, quantized with
float32 activations against the same file dequantised to float32: a prompt's tokens may part
only where the dequantised run's top two are within TINY_NEAR_TIE nats, at most half the
prompts, and until then each chosen token's logprob stays within TINY_NEAR_TIE of the
dequantised run's. Measured on Zen 3 (avx2): 0 to 3 of 8 prompts part, at gaps of 0.004-0.066
nats (random tiny models have many near-ties), and the logprobs move by at most 0.09 nats;
TINY_NEAR_TIE = 0.15 leaves a margin. A wrong kernel part (a scale, an offset, a bit plane)
moves logits by whole nats.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

import test_gguf  # noqa: E402 - the tiny llama writer
from polyrunner import LLM, SamplingParams  # noqa: E402
from polyrunner.backends.cpu import kernels  # noqa: E402
from polyrunner.backends.cpu import quant_linear as ql  # noqa: E402
from polyrunner.models.gguf import cache as gguf_cache  # noqa: E402
from polyrunner.models.gguf.quantized import select_quantization  # noqa: E402
from quant_blocks import F16_FIELDS, centered_blocks  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time,",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of thermodynamics are",
    "import numpy as np\n\nx = np.arange(10)\n",
    "My favourite recipe for pancakes:",
    "Q: What is 12 times 7?\nA:",
]
TEXT = (Path(__file__).parent / "data" / "pride_and_prejudice_ch1.txt").read_text()
NEAR_TIE = 0.35  # nats
COMMON = dict(backend="cpu", max_model_len=1024, max_num_seqs=8, kv_cache_memory_bytes=64 << 20)
QUANT = dict(COMMON, max_num_batched_tokens=ql.PREFILL_ROWS)   # every step through the integer kernels

pytestmark = pytest.mark.skipif(ql.library() is None, reason="no CPU kernel library (no C++ compiler?)")


def greedy(llm: LLM, max_tokens: int = 64, logprobs: int | None = None):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    return [o.token_ids for o in outs] if logprobs is None else [(o.token_ids, o.logprobs) for o in outs]


def assert_close_to_dequantised(outs, want, tokens: int, max_parted: int, max_moved: float) -> None:
    """TINY_PROMPTS' greedy outputs `outs` against the dequantised model's `want` ((ids, logprobs) per
    prompt): each `tokens` long, at most `max_parted` prompts parting before a near-tie, and along each
    shared prefix the chosen token's logprob moved by less than `max_moved` nats."""
    got = [o.token_ids for o in outs]
    assert all(len(a) == tokens for a in got)
    early = early_divergences(got, want, tokens, TINY_NEAR_TIE, TINY_PROMPTS)
    assert len(early) <= max_parted, early
    for prompt, o, (ids, logprobs) in zip(TINY_PROMPTS, outs, want):   # the shared prefix: logprobs close
        for i, (a, b) in enumerate(zip(o.token_ids, ids)):
            if a != b:
                break
            moved = abs(o.logprobs[i][a].logprob - logprobs[i][b].logprob)
            assert moved < max_moved, f"{prompt!r}: token {i}'s logprob moved by {moved:.3f} nats"


def early_divergences(got: list[list[int]], want: list[tuple[list[int], list]], n: int = 16,
                      near_tie: float = NEAR_TIE, prompts: list[str] = PROMPTS) -> list[str]:
    """Prompts whose first n tokens differ from the reference's; each must differ at a near-tie."""
    early = []
    for prompt, a, (b, b_logprobs) in zip(prompts, got, want):
        i = next((i for i, (x, y) in enumerate(zip(a[:n], b[:n])) if x != y), n)
        if i < n:
            top = b_logprobs[i]
            gap = top[b[i]].logprob - top[a[i]].logprob if a[i] in top else math.inf
            assert gap < near_tie, f"{prompt!r}: token {i} is {a[i]}, float32 gave {b[i]} by {gap:.3f} nats"
            early.append(prompt)
    return early


def perplexity(llm: LLM) -> float:
    out = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    lps = [pos[tok].logprob for pos, tok in zip(out.prompt_logprobs[1:], ids[1:])]
    assert len(lps) > 300
    return math.exp(-sum(lps) / len(lps))


def quant_modules(llm: LLM) -> list[ql.QuantLinear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, ql.QuantLinear)]


@pytest.fixture(scope="module")
def dense():
    llm = LLM(dtype="float32", **COMMON)
    assert llm.engine.quantization is None and not quant_modules(llm)
    return greedy(llm, logprobs=5), perplexity(llm)


@pytest.fixture(scope="module")
def quantized32():
    llm = LLM(quantization="gguf", dtype="float32", **QUANT)
    return greedy(llm), perplexity(llm)


def test_default_for_gguf_is_quantized():
    llm = LLM(**COMMON)   # a GGUF model on the CPU, dtype auto: quantized
    assert llm.engine.quantization == "gguf"
    swapped = quant_modules(llm)
    assert len(swapped) == 4 * llm.engine.arch.num_layers + 1      # qkv, o, gate_up, down per layer + LM head
    assert {m.qtype for m in swapped} == {"Q4_1", "Q8_0"}           # the file's types (Q8_0: tied embedding)


def test_quantized_float32_greedy_matches_dequantised_float32(dense, quantized32):
    got, _ = quantized32
    assert all(len(a) == 64 for a in got)
    assert len(early_divergences(got, dense[0])) <= len(PROMPTS) // 2


def test_quantized_perplexity_within_2_percent(dense, quantized32):
    assert abs(quantized32[1] / dense[1] - 1) < 0.02, (quantized32[1], dense[1])


def test_default_bfloat16_quantized_greedy_and_perplexity(dense):
    quant = LLM(**QUANT)
    assert len(early_divergences(greedy(quant), dense[0])) <= len(PROMPTS) // 2
    ppl = perplexity(quant)
    assert abs(ppl / dense[1] - 1) < 0.02, (ppl, dense[1])


def test_explicit_dtype_dequantises():
    bf16 = LLM(dtype="bfloat16", **COMMON)
    assert bf16.engine.quantization is None and not quant_modules(bf16)


def test_forced_avx2_path_gives_the_same_tokens(quantized32, monkeypatch):
    if not kernels._X86:
        pytest.skip("not an x86 CPU: no AVX2 path")
    monkeypatch.setenv("POLYRUNNER_CPU_QUANT_ISA", "avx2")
    llm = LLM(quantization="gguf", dtype="float32", **QUANT)
    assert {m.isa for m in quant_modules(llm)} == {"avx2"}
    assert [a[:16] for a in quantized32[0]] == greedy(llm, 16)


class _Backend:
    name = "nodev"
    supported_quantization = ()


def test_quantization_argument_errors_use_vllms_wording():
    gguf_config = {"polyrunner_gguf": {"quantized_weights": "gguf_quantized.json"}}
    with pytest.raises(ValueError, match=r"Quantization method specified in the model config \(None\) does not "
                                         r"match the quantization method specified in the `quantization` "
                                         r"argument \(gguf\)\."):
        select_quantization("gguf", "auto", {}, _Backend())
    with pytest.raises(ValueError, match="gguf quantization is currently not supported in nodev."):
        select_quantization("gguf", "auto", gguf_config, _Backend())
    assert select_quantization(None, "auto", gguf_config, _Backend()) is None
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="awq", **COMMON)


# ---------------------------------------------------------------- tiny models, one per type

TINY_TYPES = ["Q6_K", "Q5_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"]
TINY_PROMPTS = ["hello world", "def f(x):", "numbers 1234", "The quick brown fox", "a b c d e",
                "return x**2", "code: def", "3.14159 and"]
TINY_TOKENS = 24
TINY_NEAR_TIE = 0.15  # nats
WEIGHT_STD = 0.08
TINY = dict(backend="cpu", max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=16 << 20)


def _encode_scaled(rng: np.random.Generator, qtype: Q, rows: int, cols: int, original=test_gguf._encode_tensor):
    """test_gguf's tensor encoder, with random blocks of the tiny types whose float16 scales are
    rescaled for weights of standard deviation WEIGHT_STD; (blocks, their gguf dequantisation)."""
    if qtype.name not in TINY_TYPES:
        return original(rng, qtype, rows, cols)
    blocks = centered_blocks(rng, qtype.name, rows, cols)
    factor = WEIGHT_STD / float(gguf.quants.dequantize(blocks, qtype).std())
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    view = blocks.reshape(rows, -1, size)
    for off in F16_FIELDS[qtype.name]:
        scales = view[:, :, off:off + 2].copy().view(np.float16).astype(np.float32) * factor
        view[:, :, off:off + 2] = scales.astype(np.float16).view(np.uint8)
    return blocks, gguf.quants.dequantize(blocks, qtype)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """qtype -> a tiny llama .gguf whose linears and LM head are all of that type (cached per module)."""
    made: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("tiny_quant")

    def make(qtype: str) -> Path:
        if qtype not in made:
            names = [f"blk.{i}.{t}.weight" for i in range(2) for t in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                       "ffn_gate", "ffn_up", "ffn_down")]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(test_gguf, "_encode_tensor", _encode_scaled)
                made[qtype] = base / f"{qtype}.gguf"
                test_gguf.write_tiny_gguf(made[qtype], types={n: Q[qtype] for n in names + ["output.weight"]},
                                          seed=TINY_TYPES.index(qtype))
        return made[qtype]
    return make


@pytest.mark.parametrize("qtype", TINY_TYPES)
def test_tiny_model_of_each_type_greedy_matches_dequantised(qtype, tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_cache, "gguf_cache_root", lambda: tmp_path / "gguf")
    path = str(tiny_gguf(qtype))
    sp = SamplingParams(temperature=0, max_tokens=TINY_TOKENS, ignore_eos=True, logprobs=5)
    dense = LLM(path, dtype="float32", **TINY)
    assert dense.engine.quantization is None and not quant_modules(dense)
    want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in dense.generate(TINY_PROMPTS, sp, use_tqdm=False)]
    del dense
    quant = LLM(path, quantization="gguf", dtype="float32", max_num_batched_tokens=ql.PREFILL_ROWS, **TINY)
    swapped = quant_modules(quant)
    assert len(swapped) == 4 * 2 + 1 and {m.qtype for m in swapped} == {qtype}   # qkv, o, gate_up, down; LM head
    outs = [o.outputs[0] for o in quant.generate(TINY_PROMPTS, sp, use_tqdm=False)]
    assert_close_to_dequantised(outs, want, TINY_TOKENS, len(TINY_PROMPTS) // 2, TINY_NEAR_TIE)
