"""Quantized linears on the CPU: GGUF weight blocks run as they are (`quant_gemm.cpp`).

`quantize_model` is the CPU backend's `quantize_model` hook: each "linear" whose
GGUF type the kernels run (`QTYPES`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS) becomes a `QuantLinear` (a fused linear whose parts are of
several such types, as in llama.cpp's Q4_K_M files, a `QuantRunsLinear` of one per type,
`quant_runs.py`), and a quantized LM head becomes
the model's `quantized_lm_head` (the executor's logits and the model's `compute_logits` go
through it; an untied head also replaces `model.lm_head`, so no dense copy is loaded); other
types (none of a usual GGUF file's block types) stay dense. A quantized token embedding
becomes a `QuantEmbedding` (`quant_embedding.py`: rows dequantised per lookup; tied to the LM
head, over the head's blocks), and the "moe" modules whose 3-D expert stacks are quantized
become `QuantFusedMoE`s (`moe_module.py`) over those blocks (r8 where the path runs it, from the
repack cache like the linears', so the experts, most of a MoE file, take no more memory than in
the file).

A `QuantLinear` keeps the blocks (about 4.5 bits a weight for Q4_1, 6.56 for Q6_K)
and quantizes its input per row to int8 blocks of 32 on every call, so a decode
step streams the quantized weights once with integer dot products. The types but
Q8_0, Q2_K and Q3_K are repacked at load into the kernels' row-interleaved "r8"
layout (8 output rows per vector, at the GGUF bytes per weight: `quant_kquants_r8.cpp`,
`quant_small_r8.cpp`), and so is Q8_0 where the path has
VNNI (34 bytes, as in GGUF; ~2.5x faster for a small-vocabulary LM head at a few
rows, the same at 1 row, where the weight stream is the bound); the AVX2 and
scalar paths run Q8_0's GGUF blocks as they are, and Q2_K / Q3_K run their GGUF
blocks on every path. A step
of more than `PREFILL_ROWS` rows is compute-bound instead: it dequantises the
weight into the input's dtype and runs the dense matmul (oneDNN), faster there
(the r8 kernel wins up to ~40 rows on one thread). The two paths round differently
(int8 activations vs bfloat16 weights): a prompt computed whole and the same
prompt after a prefix-cache hit (its few remaining rows) can then flip a
near-tied greedy token. PREFILL_ROWS is 64, not 40, so that chat-sized prompts and
their cache hits take the same path; llama.cpp quantizes activations at every
batch size instead, at 2-3x the prefill cost here.

Instruction-set paths ("avx512vnni", "avxvnni", "avx2", "scalar"): each weight shape takes the
fastest the kernel library has, timed once per machine at decode row counts (`measured_isa`; the
portable build, `POLYRUNNER_CPU_SIMD=0`, stops at avx2); `POLYRUNNER_CPU_QUANT_ISA=<name>` forces
one (an error if not built).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from polyrunner.backends.cpu import envs, kernel_table, kernels, repack_cache
from polyrunner.backends.cpu.kernel_calls import call
from polyrunner.backends.cpu.moe_module import QuantFusedMoE, QuantMoEScratch, QuantStack
from polyrunner.backends.cpu.quant_embedding import QuantEmbedding
from polyrunner.backends.cpu.quant_runs import QuantRunsLinear
from polyrunner.backends.cpu.repack_cache import PreparedBlocks
from polyrunner.backends.cpu.row_linear import RowLinear

QTYPES = {  # GGML type ids the kernels run (quant_gemm.cpp, quant_kquants.cpp, quant_small.cpp)
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
    "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23,
}
ISAS = {"scalar": 0, "avx2": 1, "avxvnni": 2, "avx512vnni": 3}
MEASURE_ROWS = (1, 16)  # decode row counts the instruction-set paths are timed at (`measured_isa`)
PREFILL_ROWS = 64  # above: dequantise + dense matmul (r8 vs oneDNN bfloat16: crossover ~40 rows, 1 thread)
# the LM head (Q8_0; rows = requests, not prompt): above these rows the dequantised dense matmul is
# faster than the kernel, for the GGUF layout and the r8 layout (VNNI); figures in
# benchmarks/results/design-measurements.md
HEAD_PREFILL_ROWS = 32
HEAD_PREFILL_ROWS_R8 = 128
# the dense path dequantises the weight in slabs of rows of at most this many bytes, so its scratch stays
# small (a large LM head whole: 1 GB of float32 for 128256 x 2048, kept per thread)
DENSE_SLAB_BYTES = 32 << 20
_scratch = threading.local()  # per thread: one reused buffer for dequantised weights (no mmap/fault per call)


def library(lib: ctypes.CDLL | None = None) -> ctypes.CDLL | None:
    """`lib`, else the backend's kernel library (`kernels.paged_attention_kernel()`; its functions'
    types declared at load); None without one."""
    return lib if lib is not None else kernels.paged_attention_kernel()


def isa_unavailable_reason(isa: str, lib: ctypes.CDLL | None = None) -> str | None:
    """None when path `isa` runs with `lib` (default: the backend's library), else why not."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction-set path {isa!r}; allowed: {', '.join(ISAS)}")
    lib = library(lib)
    if lib is None:
        return "no CPU kernel library (no C++ compiler, or POLYRUNNER_CPU_KERNELS=0)"
    if not lib.pr_quant_isa_compiled(ISAS[isa]):
        return f"this kernel build has no {isa} code (the CPU or the portable build lacks it)"
    return None


def default_isa(lib: ctypes.CDLL | None = None) -> str:
    """`POLYRUNNER_CPU_QUANT_ISA`, else the fastest path `lib` has."""
    forced = envs.QUANT_ISA.get()
    if forced:
        why = isa_unavailable_reason(forced, lib)
        if why is not None:
            raise ValueError(f"POLYRUNNER_CPU_QUANT_ISA={forced}: {why}")
        return forced
    best = library(lib).pr_quant_best_isa()
    return next(name for name, i in ISAS.items() if i == best)


def measured_isa(qtype: str, blocks: torch.Tensor, shape: tuple[int, int], r8: bool,
                 lib: ctypes.CDLL | None = None) -> str:
    """The fastest compiled path for `blocks` (`r8`: in the r8 layout) at decode row counts
    (`MEASURE_ROWS`, summed), timed once per machine (the linear kernels' table, `kernel_table.cached`,
    one thread: it runs before the engine starts its pool); the only one when there is one."""
    lib = library(lib)
    isas = [i for i in ISAS if isa_unavailable_reason(i, lib) is None and i != "scalar"   # scalar: the fallback
            and (not r8 or r8_supported(qtype, shape, i, lib))]
    if len(isas) <= 1:
        return isas[0] if isas else default_isa(lib)

    def measure() -> kernel_table.Times:
        calls = max(1, min(8, (4 << 20) // max(1, blocks.numel())))   # ~4 MiB of weights per timing
        best: kernel_table.Times = {i: {} for i in isas}
        for M in MEASURE_ROWS:
            x = torch.randn(M, shape[1], generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
            at_m = kernel_table.time_in_turns(
                {i: (lambda i=i, x=x: [quant_matmul(qtype, blocks, shape[1], x, None, i, lib, r8)
                                       for _ in range(calls)])
                 for i in isas}, dict.fromkeys(isas, calls))
            for i, t in at_m.items():
                best[i][M] = t
        return best

    times = kernel_table.cached(f"quant {qtype} {shape[0]}x{shape[1]}{' r8' if r8 else ''}", measure, threads=1)
    return min(isas, key=lambda i: sum(t if t is not None else float("inf") for t in times.get(i, {}).values())
               if times.get(i) else float("inf"))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (code {rc}: 1 unknown type or path, 2 bad K)")


def r8_supported(qtype: str, shape: tuple[int, int], isa: str, lib: ctypes.CDLL | None = None) -> bool:
    """Whether a `shape` weight of `qtype` runs in the r8 layout on path `isa` (Q8_0: the VNNI
    paths only, `quant_gemm.cpp`)."""
    return (qtype in QTYPES and isa in ISAS and shape[0] % 8 == 0 and shape[1] % 32 == 0
            and bool(library(lib).pr_quant_r8_isa(QTYPES[qtype], ISAS[isa])))


def repack8(qtype: str, blocks: torch.Tensor, in_features: int, lib: ctypes.CDLL | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF blocks `[N, row_bytes]` -> the r8 layout (uint8 `[N / 8, group_bytes]`), into `out`
    (contiguous uint8 of `pr_quant_r8_bytes` bytes) when given."""
    lib = library(lib)
    N = blocks.shape[0]
    nbytes = lib.pr_quant_r8_bytes(QTYPES[qtype], N, in_features)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
    elif out.numel() != nbytes or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"out: {nbytes} contiguous uint8 bytes expected, got {out.dtype} {tuple(out.shape)}")
    _check(lib.pr_quant_repack8(QTYPES[qtype], blocks.contiguous().data_ptr(), N, in_features, out.data_ptr()),
           "pr_quant_repack8")
    return out.view(N // 8, -1)


def quant_matmul(qtype: str, blocks: torch.Tensor, in_features: int, x: torch.Tensor,
                 out_dtype: torch.dtype | None = None, isa: str | None = None,
                 lib: ctypes.CDLL | None = None, r8: bool = False) -> torch.Tensor:
    """`x [M, K] @ W^T` -> `[M, N]` in `out_dtype` (default x's); W: `blocks` uint8
    `[N, row_bytes]` of GGUF type `qtype` (r8: `repack8`'s `[N / 8, ...]`); x float32
    or bfloat16, unit stride on K."""
    lib = library(lib)
    isa = isa or default_isa(lib)
    M, K = x.shape
    if K != in_features or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32/bfloat16 [M, {in_features}] with unit stride, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    out_dtype = out_dtype or x.dtype
    N = blocks.shape[0] * (8 if r8 else 1)
    y = torch.empty((M, N), dtype=out_dtype)
    fn = lib.pr_quant_linear8 if r8 else lib.pr_quant_linear
    _check(call(fn, QTYPES[qtype], blocks.data_ptr(), N, K, x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16),
                M, y.data_ptr(), y.stride(0), int(out_dtype == torch.bfloat16), ISAS[isa]), "pr_quant_linear")
    return y


def dequantize(qtype: str, blocks: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32,
               lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None, r8: bool = False) -> torch.Tensor:
    """The weights `[N, K]` in `dtype` (float32 or bfloat16), into `out` when given."""
    lib = library(lib)
    N = blocks.shape[0] * (8 if r8 else 1)
    out = torch.empty((N, in_features), dtype=dtype) if out is None else out
    fn = lib.pr_quant_dequantize8 if r8 else lib.pr_quant_dequantize
    _check(fn(QTYPES[qtype], blocks.data_ptr(), N, in_features, out.data_ptr(), int(dtype == torch.bfloat16)),
           "pr_quant_dequantize")
    return out


class QuantLinear(RowLinear):
    """`x @ W^T + bias` with W in GGUF blocks (see the module docstring); the
    output in `out_dtype`, or the input's dtype when None."""

    def __init__(self, qtype: str, blocks: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, lib: ctypes.CDLL | None = None,
                 dense_above: int = PREFILL_ROWS, prepared: bool = False) -> None:
        """`bias`: a dense layer's bias Parameter is kept as this module's (loaded later in place);
        `dense_above`: steps of more rows dequantise and run the dense matmul; `prepared`: `blocks`
        are already in the layout this machine runs (`uses_r8`: r8 or GGUF), e.g. the repack cache's."""
        super().__init__()
        self.dense_above = dense_above
        if qtype not in QTYPES:
            raise ValueError(f"GGUF type {qtype!r} has no CPU kernel; allowed: {', '.join(QTYPES)}")
        self.qtype, self.out_features, self.in_features = qtype, shape[0], shape[1]
        self.out_dtype = out_dtype
        self.lib = library(lib)
        best = default_isa(self.lib)
        self.r8 = r8_supported(qtype, shape, best, self.lib)
        if self.r8 and not prepared:
            blocks = repack8(qtype, blocks, self.in_features, self.lib)
        if blocks.dim() != 2 or blocks.shape[0] != (shape[0] // 8 if self.r8 else shape[0]):
            raise ValueError(f"{qtype} {shape}: blocks of shape {tuple(blocks.shape)} are not in the "
                             f"{'r8' if self.r8 else 'GGUF'} layout")
        self.isa = best if envs.QUANT_ISA.get() else measured_isa(qtype, blocks, shape, self.r8, self.lib)
        self.register_buffer("blocks", blocks, persistent=False)
        # the decode call, bound once (a step makes ~4 per layer: keep the Python path short)
        self._call = (self.lib.pr_quant_linear8 if self.r8 else self.lib.pr_quant_linear,
                      QTYPES[qtype], self.out_features, self.in_features, ISAS[self.isa])
        self.bias = bias if isinstance(bias, nn.Parameter) or bias is None else nn.Parameter(bias.detach(), False)

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.dense_above:
            y = self._dense(x)
            y = y if self.out_dtype is None else y.to(self.out_dtype)
        elif x.dtype in (torch.float32, torch.bfloat16) and x.shape[1] == self.in_features:
            fn, qt, N, K, isa = self._call
            out_dtype = self.out_dtype or x.dtype
            y = torch.empty((x.shape[0], N), dtype=out_dtype)
            _check(call(fn, qt, self.blocks.data_ptr(), N, K, x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16,
                        x.shape[0], y.data_ptr(), N, out_dtype == torch.bfloat16, isa), "pr_quant_linear")
        else:
            y = quant_matmul(self.qtype, self.blocks, self.in_features, x, self.out_dtype, self.isa, self.lib,
                             self.r8)   # raises the error naming what is wrong
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`x [M, in_features]` (unit stride on K) `@ W^T` into `out`, an `[M, out_features]` float32 or
        bfloat16 view with unit column stride and any row stride (a column slice of a wider output,
        `quant_runs.QuantRunsLinear`), without the bias: the kernel writes there directly; a step of more
        than `dense_above` rows computes the dense product, then copies it in."""
        M, N = x.shape[0], self.out_features
        if (x.dim() != 2 or x.shape[1] != self.in_features or x.stride(1) != 1
                or x.dtype not in (torch.float32, torch.bfloat16) or tuple(out.shape) != (M, N)
                or out.stride(1) != 1 or out.dtype not in (torch.float32, torch.bfloat16)):
            raise ValueError(f"forward_into: x float32/bfloat16 [M, {self.in_features}] with unit stride and out "
                             f"[M, {N}] with unit column stride expected, got x {x.dtype} {tuple(x.shape)} "
                             f"{x.stride()}, out {out.dtype} {tuple(out.shape)} {out.stride()}")
        if M > self.dense_above:
            out.copy_(self._dense(x))
            return
        fn, qt, N, K, isa = self._call
        _check(call(fn, qt, self.blocks.data_ptr(), N, K, x.data_ptr(), x.stride(0), x.dtype == torch.bfloat16,
                    M, out.data_ptr(), out.stride(0), out.dtype == torch.bfloat16, isa), "pr_quant_linear")

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W^T` in x's dtype through W dequantised a slab of rows at a time (`DENSE_SLAB_BYTES`)."""
        N, K = self.out_features, self.in_features
        rows = max(8, DENSE_SLAB_BYTES // (K * x.element_size()) // 8 * 8)   # whole r8 groups
        if rows >= N:
            return F.linear(x, dequantize(self.qtype, self.blocks, K, x.dtype, self.lib, _scratch_weight(N, K, x.dtype),
                                          self.r8))
        y, per = torch.empty((x.shape[0], N), dtype=x.dtype), 8 if self.r8 else 1
        for n0 in range(0, N, rows):   # a loop over slabs of the weight
            n = min(rows, N - n0)
            w = dequantize(self.qtype, self.blocks[n0 // per:(n0 + n) // per], K, x.dtype, self.lib,
                           _scratch_weight(n, K, x.dtype), self.r8)
            y[:, n0:n0 + n] = F.linear(x, w)
        return y

    def extra_repr(self) -> str:
        return (f"{self.qtype}, in_features={self.in_features}, out_features={self.out_features}, isa={self.isa}"
                f"{', r8' if self.r8 else ''}")


def _scratch_weight(N: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused `[N, K]` buffer of this thread (its contents are dead after the call that fills it)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < N * K:
        buf = _scratch.buf = torch.empty(max(N * K, 0 if buf is None else buf.numel()), dtype=dtype)
    return buf[:N * K].view(N, K)


def _module(weight, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None,
            dense_above: int = PREFILL_ROWS, prepared: PreparedBlocks | None = None) -> QuantLinear | None:
    if weight.qtype not in QTYPES or weight.shape[1] % 32:
        return None
    cached = prepared.get(weight.key) if prepared is not None else None
    blocks = cached[1] if cached is not None else torch.from_numpy(weight.blocks)
    return QuantLinear(weight.qtype, blocks, weight.shape, bias, out_dtype, dense_above=dense_above,
                       prepared=cached is not None)


def _runs_module(runs, bias: torch.Tensor | None, prepared: PreparedBlocks) -> QuantRunsLinear | None:
    """A fused linear of several types over its runs (`QuantizedModel.mixed`), None when a run's type has
    no kernel (it then stays dense, whole)."""
    parts = [_module(w, None, prepared=prepared) for w in runs]
    ready = [p for p in parts if p is not None]
    return QuantRunsLinear(ready, bias) if len(ready) == len(parts) else None


def uses_r8(qtype: str, shape: tuple[int, int], lib: ctypes.CDLL | None = None) -> bool:
    """Whether a `QuantLinear` of this type and shape runs the r8 layout here (the path `default_isa` picks)."""
    return r8_supported(qtype, shape, default_isa(lib), lib)


def prepare_blocks(weights) -> PreparedBlocks:
    """The blocks of the linears (a mixed-type fused linear's runs too) and the LM head of `weights` (a
    `QuantizedModel`) that run in a layout of their own (r8, or a fused linear's stacked rows), from the
    repack cache (`repack_cache.py`: written at the first start, mapped at every start)."""
    lib = library()
    experts = {id(w): ex.num_experts for _, _, _, ex in weights.experts
               for w in (ex.gate, ex.up, ex.down)}   # stacks of experts: r8 per expert's rows
    matrices = [w for _, _, _, w in weights.linears] + [w for _, _, _, ws in weights.mixed for w in ws]
    matrices += [weights.lm_head] + [w for _, _, _, ex in weights.experts for w in (ex.gate, ex.up, ex.down)]

    def layout(w) -> str | None:
        if w.qtype not in QTYPES or w.shape[1] % 32:
            return None
        rows = w.shape[0] // experts.get(id(w), 1)
        return "r8" if uses_r8(w.qtype, (rows, w.shape[1]), lib) else "gguf"

    tag = f"{Path(getattr(lib, '_name', '') or 'none').name} {default_isa(lib)}"
    return repack_cache.prepare(matrices, layout, lambda w: lib.pr_quant_r8_bytes(QTYPES[w.qtype], *w.shape),
                                lambda w, blocks, out: repack8(w.qtype, blocks, w.shape[1], lib, out), tag)


def quantize_model(model: nn.Module, weights) -> int:
    """The CPU backend's `quantize_model`: swap every linear whose type has a kernel
    for a `QuantLinear` (a fused linear of several types, `weights.mixed`, for a `QuantRunsLinear` of
    one per run, `quant_runs.py`), set `model.quantized_lm_head` (float32 logits) when the LM
    head's type has one (an untied one replaces `model.lm_head` too), swap a quantized
    token embedding for a `QuantEmbedding` and quantized experts for `QuantFusedMoE`s
    (the module docstring). Returns how many modules it made (0 without the kernel library)."""
    if library() is None:
        return 0
    n = 0
    prepared = prepare_blocks(weights)
    for parent, attr, dense, weight in weights.linears:
        new = _module(weight, dense.bias, prepared=prepared)
        if new is not None:
            setattr(parent, attr, new)
            n += 1
    for parent, attr, dense, runs in weights.mixed:
        mixed = _runs_module(runs, dense.bias, prepared)
        if mixed is not None:
            setattr(parent, attr, mixed)
            n += 1
    head = None if weights.lm_head is None else _module(weights.lm_head, None, torch.float32, HEAD_PREFILL_ROWS,
                                                        prepared)
    if head is not None:
        head.dense_above = HEAD_PREFILL_ROWS_R8 if head.r8 else HEAD_PREFILL_ROWS
        model.quantized_lm_head = head
        if isinstance(getattr(model, "lm_head", None), nn.Linear) and weights.lm_head is not weights.embedding:
            model.lm_head = head   # the dense matrix is then not loaded
        n += 1
    embedding = _embedding(model, weights, head)
    if embedding is not None:
        model.embed_tokens = embedding
        n += 1
    scratch, isa = QuantMoEScratch(), default_isa()
    for parent, attr, moe, experts in weights.experts:
        new_moe = _experts(moe, experts, isa, scratch, prepared)
        if new_moe is not None:
            setattr(parent, attr, new_moe)
            n += 1
    return n


def _embedding(model: nn.Module, weights, head: QuantLinear | None) -> QuantEmbedding | None:
    """The token embedding over its blocks (tied: the LM head's, in its layout), None when it stays dense."""
    dense, quantized = getattr(model, "embed_tokens", None), weights.embedding
    if quantized is None or not isinstance(dense, nn.Embedding) or dense.weight.dtype not in kernels.DTYPES:
        return None
    if quantized is weights.lm_head:   # tied: one copy, the head's
        if head is None:
            return None
        return QuantEmbedding(head.qtype, QTYPES[head.qtype], head.blocks, head.out_features, head.in_features,
                              dense.weight.dtype, head.r8)
    if quantized.qtype not in QTYPES:
        return None
    return QuantEmbedding(quantized.qtype, QTYPES[quantized.qtype], torch.from_numpy(quantized.blocks),
                          *quantized.shape, dense.weight.dtype)


def _experts(moe: nn.Module, experts, isa: str, scratch: QuantMoEScratch,
             prepared: PreparedBlocks | None = None) -> QuantFusedMoE | None:
    """`moe`'s experts over their blocks (`QuantizedExperts`: gate, up, down stacks), None when a type
    has no kernel or the shape is beyond `pr_moe_quant`'s limits."""
    lib = library()
    num, inter = experts.num_experts, moe.intermediate
    hidden = experts.down.shape[0] // num
    types = (experts.gate.qtype, experts.up.qtype, experts.down.qtype)
    if lib is None or any(t not in QTYPES for t in types) or types[0] != types[1] or hidden > 8192 or num > 1024:
        return None
    gate, up = (_expert_stack(w, num, isa, prepared) for w in (experts.gate, experts.up))
    return QuantFusedMoE(moe, hidden, gate, up, _expert_stack(experts.down, num, isa, prepared), ISAS[isa], lib,
                         *scratch.get(lib, hidden, inter, num, moe.top_k))


def _expert_stack(weight, num: int, isa: str, prepared: PreparedBlocks | None = None) -> QuantStack:
    """A stack of `num` experts' rows (`weight`, `[num * N, K]`) as `[num, N, row_bytes]`: the file's
    blocks as they are (a view of its pages), or each expert in r8 where path `isa` runs that layout
    and it takes no more bytes than the GGUF one: from the repack cache (`prepared`: the whole stack
    repacked as one matrix, which is each expert's r8 groups in turn, as N is a multiple of 8), else
    repacked here."""
    lib, qt = library(), QTYPES[weight.qtype]
    (N, K) = shape = weight.shape[0] // num, weight.shape[1]
    stack = torch.from_numpy(weight.blocks).view(num, N, -1)
    if not r8_supported(weight.qtype, shape, isa, lib) or lib.pr_quant_r8_bytes(qt, N, K) > N * stack.shape[2]:
        return QuantStack(weight.qtype, qt, stack, False)
    cached = prepared.get(weight.key) if prepared is not None else None
    if cached is not None and cached[0] == "r8":
        return QuantStack(weight.qtype, qt, cached[1].view(num, N // 8, -1), True)
    out = torch.empty((num, N // 8, lib.pr_quant_r8_bytes(qt, N, K) // (N // 8)), dtype=torch.uint8)
    for e in range(num):   # a loop over experts, once at load
        _check(lib.pr_quant_repack8(qt, stack[e].data_ptr(), N, K, out[e].data_ptr()), "pr_quant_repack8")
    return QuantStack(weight.qtype, qt, out, True)


def quantized_lm_head(model: nn.Module) -> QuantLinear | None:
    """The LM head `quantize_model` set on `model`, if any."""
    head = getattr(model, "quantized_lm_head", None)
    return head if isinstance(head, QuantLinear) else None
