"""CPU fast paths against the reference: the C++ paged attention kernel (each
build: `cpu_kernels`) and the SDPA prefill path against the reference attention;
packed linears; the whole model under every path combination the backend can
take (AMX / oneDNN / unpacked linears, AVX-512 / portable / no C++ kernels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from block_tables import random_block_tables
from polyrunner.attention.metadata import AttentionMetadata, LayerSpec
from polyrunner.attention.reference import reference_paged_attention
from polyrunner.backends.cpu import kernels
from polyrunner.backends.cpu.attention import cpu_paged_attention
from tolerances import (
    assert_close_ulp,
    assert_detects_errors,
    assert_linear_close,
    attention_reference,
    rms_norm_reference,
    unit_roundoff,
)


def _batch(rng, *, num_decodes, num_prefills, block_size, num_blocks, max_blocks, pad_tokens=0,
           pad_reqs=0):
    """A random decode-first batch over random, non-overlapping block tables."""
    qlens, ctx = [], []
    for _ in range(num_decodes):
        qlens.append(1)
        ctx.append(int(rng.integers(1, max_blocks * block_size)))
    for i in range(num_prefills):
        n = int(rng.integers(2, 40))
        prior = 0 if i % 2 == 0 else int(rng.integers(1, max_blocks * block_size - n))
        qlens.append(n)
        ctx.append(prior + n)
    R, T = len(qlens), sum(qlens)
    tables = random_block_tables(rng, ctx, block_size, num_blocks, R + pad_reqs, max_blocks)
    qsl = np.full(R + pad_reqs + 1, T, np.int32)
    qsl[0] = 0
    qsl[1:R + 1] = np.cumsum(qlens)
    seq_lens = np.zeros(R + pad_reqs, np.int32)
    seq_lens[:R] = ctx
    tok_req = np.zeros(T + pad_tokens, np.int32)
    positions = np.zeros(T + pad_tokens, np.int64)
    slots = np.zeros(T + pad_tokens, np.int64)  # padded tokens write the null slot
    for r in range(R):
        s, e = qsl[r], qsl[r + 1]
        pos = np.arange(ctx[r] - (e - s), ctx[r])
        tok_req[s:e] = r
        positions[s:e] = pos
        slots[s:e] = tables[r, pos // block_size].astype(np.int64) * block_size + pos % block_size
    t = torch.from_numpy
    return AttentionMetadata(
        num_actual_tokens=T, num_reqs=R, num_decodes=num_decodes, max_query_len=max(qlens),
        max_seq_len=max(ctx), query_start_loc=t(qsl), seq_lens=t(seq_lens), block_tables=t(tables),
        slot_mapping=t(slots), positions=t(positions), token_to_req=t(tok_req),
        query_start_loc_np=qsl, seq_lens_np=seq_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (6, 2, None), (8, 2, 7), (9, 3, 40)])
@pytest.mark.parametrize("seed", [0, 1])
# bfloat16 paths of the AVX-512 build: head 64/128 with blocks <= 16 (16 keys per pass), other
# multiples of 32 or larger blocks (one key at a time), the rest (80) the plain loop
@pytest.mark.parametrize("head,block_size", [(64, 16), (128, 16), (96, 16), (64, 32), (80, 16)])
def test_kernel_matches_reference(cpu_kernels, dtype, heads, kv_heads, window, seed, head, block_size):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    num_blocks = 96
    meta = _batch(rng, num_decodes=int(rng.integers(0, 6)), num_prefills=int(rng.integers(1, 4)),
                  block_size=block_size, num_blocks=num_blocks, max_blocks=6, pad_tokens=3)
    T = meta.num_padded_tokens
    q = torch.randn(T, heads, head, generator=g).to(dtype)
    # k and v as strided views of one fused projection, like the model's qkv split
    kv = torch.randn(T, 2 * kv_heads * head + 32, generator=g).to(dtype)
    k = kv[:, : kv_heads * head].view(T, kv_heads, head)
    v = kv[:, kv_heads * head: 2 * kv_heads * head].view(T, kv_heads, head)
    spec = LayerSpec(heads, kv_heads, head, head ** -0.5, window)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head, generator=g).to(dtype)
    cache_ref = cache.clone()
    # the cached context before this step: identical in both caches
    reference_paged_attention(q, k, v, cache_ref, meta, spec)
    # float64 reference; fp32 math, bfloat16 prefills with P rounded to bfloat16 (SDPA, the prefill kernel)
    expected, bound = attention_reference(q, k, v, cache, meta, spec,
                                          p_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None)
    got = cpu_paged_attention(q, k, v, cache, meta, spec)
    n = meta.num_actual_tokens
    # 1% off fails; bfloat16 prefills round P to bfloat16 (up to 2^-8 of sum P|v| per output): 2%
    assert_detects_errors(lambda out: assert_close_ulp(out, expected[:n], dtype, ulps=1, abs_err=bound[:n]),
                          got[:n], rel=0.02 if dtype == torch.bfloat16 else 0.01)
    assert torch.equal(cache[:, 1:], cache_ref[:, 1:])  # same slots written
    assert torch.all(got[n:] == 0)


def test_kernel_decode_all_requests_with_padding(cpu_kernels):
    """The compiled path: one op call over padded requests (seq_len 0) and tokens."""
    rng = np.random.default_rng(3)
    meta = _batch(rng, num_decodes=5, num_prefills=0, block_size=16, num_blocks=64, max_blocks=4,
                  pad_tokens=3, pad_reqs=3)
    T, (H, Hkv, D) = meta.num_padded_tokens, (9, 3, 64)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(T, h, D, generator=g).to(torch.bfloat16) for h in (H, Hkv, Hkv))
    spec = LayerSpec(H, Hkv, D, D ** -0.5, None)
    cache = torch.randn(2, 64, 16, Hkv, D, generator=g).to(torch.bfloat16)
    expected, bound = attention_reference(q, k, v, cache, meta, spec)
    out = torch.zeros_like(q)
    kernels.paged_attention_op(q, k, v, cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                               meta.block_tables, out, spec.scale, 0)
    assert_close_ulp(out[:5], expected[:5], ulps=1, abs_err=bound[:5])
    assert torch.all(out[5:] == 0)


# ---- packed weights and the whole model ------------------------------------------
from polyrunner.backends.cpu.executor import ThreadGovernor  # noqa: E402
from polyrunner.backends.cpu.op_overrides import LinearPacker, cpu_op_overrides  # noqa: E402
from polyrunner.backends.cpu.packed_linear import PackedLinear, packing_supported  # noqa: E402
from polyrunner.ops import apply_overrides  # noqa: E402

needs_packing = pytest.mark.skipif(not packing_supported(torch.bfloat16),
                                   reason="oneDNN bfloat16 packing unavailable on this CPU")


@needs_packing
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_linear(monkeypatch, bias):
    """oneDNN for every batch size: with a bias, or without the small-M kernels (forced off here)."""
    monkeypatch.setenv("POLYRUNNER_CPU_AMX", "0")
    monkeypatch.setenv("POLYRUNNER_CPU_DPBF16", "0")
    monkeypatch.setenv("POLYRUNNER_CPU_AVX512", "0")
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    with kernels.use_kernels("native"):
        packed = PackedLinear(lin.weight, lin.bias, 64)
    assert packed.plan == ("onednn",) and packed.pool_rows == 0
    g = torch.Generator().manual_seed(1)
    for shape in [(1, 96), (37, 96), (64, 96), (130, 96), (3, 5, 96)]:
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        for name, y in (("packed", packed(x)), ("torch", lin(x))):   # both within rounding of the exact linear
            assert_linear_close(y, x, lin.weight, lin.bias, msg=f"{name} {shape}: ")


class _Declared(torch.nn.Module):
    """Declares `a` and `b` as replaceable linears; `head` is not declared."""

    def __init__(self, hook: bool = True) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8).to(torch.bfloat16)
        if not hook:
            self.replaceable_modules = None

    def replaceable_modules(self):
        yield "linear", self, "a", self.a
        yield "linear", self, "b", self.b
        yield "some_future_role", self, "head", self.head  # unknown roles are skipped


@needs_packing
def test_linear_override_packs_only_declared_bfloat16_linears():
    model = _Declared()
    assert apply_overrides(model, {"linear": LinearPacker(16)}) == {"linear": 1}
    assert isinstance(model.a, PackedLinear) and type(model.b) is torch.nn.Linear
    assert type(model.head) is torch.nn.Linear  # bfloat16, but not declared a "linear"


@needs_packing
def test_a_model_without_the_hook_is_left_alone():
    model = _Declared(hook=False)
    assert apply_overrides(model, cpu_op_overrides(executor_config(), torch.bfloat16)) == {}
    assert all(type(m) is torch.nn.Linear for m in (model.a, model.b, model.head))


def test_cpu_op_overrides_by_dtype(cpu_kernels):
    """A float32 model gets the fused norms, rotary and SiLU * up (its linears stay torch's or the
    quantized ones; no MoE kernel); a float16 model keeps the core's modules."""
    assert set(cpu_op_overrides(executor_config(), torch.float32)) == {"rms_norm", "rotary", "gated_mlp"}
    assert cpu_op_overrides(executor_config(), torch.float16) == {}


def test_float32_overrides_swap_the_norms_rotary_and_mlp(tiny_model_factory, cpu_kernels):
    """float32: every norm, the MLPs and the shared rotary fused; the linears are left to torch."""
    from polyrunner.backends.cpu.fused_modules import FusedMLP, FusedRMSNorm, FusedRotary
    folder, _ = tiny_model_factory("qwen3")
    model, arch = _tiny_model(folder, cpu_paged_attention, torch.float32)
    replaced = apply_overrides(model, cpu_op_overrides(executor_config(), torch.float32))
    assert replaced == {"rms_norm": 4 * arch.num_layers + 1, "rotary": 1, "gated_mlp": arch.num_layers}
    want = {"linear": torch.nn.Linear, "rms_norm": FusedRMSNorm, "gated_mlp": FusedMLP, "rotary": FusedRotary}
    for role, _, name, module in model.replaceable_modules():
        assert type(module) is want[role], (role, name)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_llama_declares_every_replaceable_part(tiny_model_factory, kind):
    """The model protocol's hook names every projection but the LM head, every
    norm, every MLP and the shared rotary module, each under its role."""
    from polyrunner.ops import GatedMLP, RMSNorm, RotaryEmbedding
    folder, _ = tiny_model_factory(kind)
    model, arch = _tiny_model(folder, reference_paged_attention, torch.float32)
    parts = list(model.replaceable_modules())
    for _, parent, name, module in parts:
        assert getattr(parent, name) is module
    by_role = {role: [m for r, _, _, m in parts if r == role] for role in {r for r, *_ in parts}}
    assert set(by_role) == {"linear", "rms_norm", "gated_mlp", "rotary"}
    linears = [m for n, m in model.named_modules() if type(m) is torch.nn.Linear and n != "lm_head"]
    assert {id(m) for m in by_role["linear"]} == {id(m) for m in linears} and len(by_role["linear"]) == len(linears)
    assert all(m is not model.lm_head for m in by_role["linear"])
    for role, cls in (("rms_norm", RMSNorm), ("gated_mlp", GatedMLP), ("rotary", RotaryEmbedding)):
        want = {id(m) for m in model.modules() if type(m) is cls}
        assert {id(m) for m in by_role[role]} == want, role
    assert len(by_role["rotary"]) == 1 + arch.num_layers  # the model's and each attention's reference


@needs_packing
def test_cpu_op_overrides_swap_exactly_the_declared_parts(tiny_model_factory, cpu_kernels):
    """Every declared part, once (the shared rotary: one module); the executor keeps them."""
    from polyrunner.backends.cpu.executor import CPUExecutor
    from polyrunner.backends.cpu.fused_modules import FusedMLP, FusedRMSNorm, FusedRotary
    folder, _ = tiny_model_factory("qwen3")
    model, arch = _tiny_model(folder, cpu_paged_attention, torch.bfloat16)
    replaced = apply_overrides(model, cpu_op_overrides(executor_config(), torch.bfloat16))
    assert replaced == {"linear": 4 * arch.num_layers, "rms_norm": 4 * arch.num_layers + 1, "rotary": 1,
                        "gated_mlp": arch.num_layers, "moe": 0}   # qwen3: q/k norms; dense: no experts
    CPUExecutor(model, executor_config())
    want = {"linear": PackedLinear, "rms_norm": FusedRMSNorm, "gated_mlp": FusedMLP, "rotary": FusedRotary}
    for role, _, name, module in model.replaceable_modules():
        assert type(module) is want[role], (role, name)
    assert type(model.embed_tokens) is torch.nn.Embedding
    rotaries = {id(layer.self_attn.rotary) for layer in model.layers} | {id(model.rotary)}
    assert len(rotaries) == 1  # still one shared module
    mlp = model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear)


def test_thread_governor_stays_in_range():
    gov = ThreadGovernor(2, interval=0.0)
    for _ in range(5):
        assert 1 <= gov.threads() <= 2
    assert ThreadGovernor(1).threads() == 1


def test_thread_governor_counts_only_the_time_the_engine_steps(monkeypatch):
    """Others busy while the engine steps -> fewer threads; a busy spell of theirs
    while the engine sat idle (a client starting up) does not count."""
    monkeypatch.setattr("polyrunner.backends.cpu.executor.available_cpus", lambda: 2)
    now = [0.0]
    busy = [0.0]      # seconds all CPUs were busy
    own = [0.0]       # seconds this process ran

    def advance(seconds: float, own_cores: float, other_cores: float) -> None:
        now[0] += seconds
        own[0] += seconds * own_cores
        busy[0] += seconds * (own_cores + other_cores)

    gov = ThreadGovernor(2, interval=0.5, stale_after=2.0, sample=lambda: (now[0], busy[0], own[0]),
                         clock=lambda: now[0])
    advance(0.6, own_cores=1.0, other_cores=0.9)      # stepping, another process holds a core
    assert gov.threads() == 1
    advance(0.6, own_cores=2.0, other_cores=0.0)      # it left
    assert gov.threads() == 2
    advance(0.2, own_cores=2.0, other_cores=1.0)      # within the interval: no new reading
    assert gov.threads() == 2
    advance(0.4, own_cores=1.0, other_cores=1.0)
    assert gov.threads() == 1
    advance(7.0, own_cores=0.0, other_cores=1.0)      # engine idle; a client starts up
    assert gov.threads() == 2
    advance(0.6, own_cores=2.0, other_cores=0.1)
    assert gov.threads() == 2


def executor_config():
    """What `CPUExecutor` and `cpu_op_overrides` read of an engine config (eager: these tests call `run`
    directly)."""
    from types import SimpleNamespace
    return SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=256, max_num_seqs=8),
                           runner=SimpleNamespace(enforce_eager=True, token_buckets=None),
                           parallel=SimpleNamespace(tensor_parallel_size=1),
                           cache=SimpleNamespace(block_size=16))


def _tiny_model(folder, attn_op, dtype):
    from polyrunner.models.arch import DecoderArch
    from polyrunner.models.loader import load_model, read_hf_config
    from polyrunner.models.registry import resolve_model_class
    arch = DecoderArch.from_hf_config(read_hf_config(folder))
    model = load_model(folder, resolve_model_class(arch.architecture), arch, attn_op, 512, dtype,
                       torch.device("cpu"))
    return model, arch


# every combination of paths the CPU backend takes on some CPU, forced where the hardware
# allows: (kernel build or None for no library, environment)
MODEL_PATHS = {
    "measured": ("native", {"POLYRUNNER_CPU_LINEAR": "auto"}),   # each linear's kernels as timed here
    "amx": ("native", {"POLYRUNNER_CPU_LINEAR": "amx"}),         # AMX linears (AMX CPUs)
    "dpbf16": ("native", {"POLYRUNNER_CPU_LINEAR": "dpbf16"}),   # AVX512_BF16 linears
    "avx512": ("native", {"POLYRUNNER_CPU_LINEAR": "avx512"}),   # AVX-512F float32-FMA linears
    "onednn": ("native", {"POLYRUNNER_CPU_AMX": "0", "POLYRUNNER_CPU_DPBF16": "0",
                          "POLYRUNNER_CPU_AVX512": "0"}),   # oneDNN-packed linears
    "portable": ("portable", {}),                           # an AVX2-only CPU's C++ kernels
    "unpacked": ("native", {"POLYRUNNER_CPU_PACK": "0"}),   # plain F.linear (no oneDNN bf16 packing)
    "unfused": ("native", {"POLYRUNNER_CPU_FUSE": "0"}),    # the model's own elementwise modules
    "no_kernels": (None, {}),                               # no compiler: reference attention, unfused
}


@pytest.mark.parametrize("path", list(MODEL_PATHS))
@pytest.mark.parametrize("kind", ["mistral", "qwen3"])
def test_fast_model_matches_reference_model(tiny_model_factory, monkeypatch, kind, path):
    """The whole bfloat16 model through the CPU executor, on every path, is as close to the
    exact (float64) model as the plain bfloat16 model with the reference attention is: a mixed
    decode + prefill batch over a pre-filled cache, then a decode-only one (AMX-sized).

    No fixed tolerance: a model's bfloat16 error compounds over layers and has no simple bound,
    so the yardstick is the plain bfloat16 model's own error against float64 on the same
    inputs (the same rounding, whatever the machine). Measured (Xeon with AMX): the fast paths'
    RMS logit error is 0.96-1.06x the plain model's, their largest 0.92-1.23x (limits: 1.5x, 2x);
    an attention with a 2% wrong scale, or a sliding window one key short, fails. Elementwise
    precision is the kernel tests' job (test_cpu_kernels_fast, test_cpu_decode_kernels, above)."""
    from polyrunner.backends.cpu.executor import CPUExecutor
    from polyrunner.backends.cpu.fused_modules import FusedMLP
    from polyrunner.device.backend import ModelInputs
    variant, env = MODEL_PATHS[path]
    if variant is not None and kernels.load_library(variant) is None:
        pytest.skip("no C++ compiler: the CPU kernel library is not built")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    folder, _ = tiny_model_factory(kind)
    dtype = torch.bfloat16
    with kernels.use_kernels(variant):
        if path == "amx" and not kernels.amx_available():
            pytest.skip(f"no AMX linear: {kernels.amx_unavailable_reason()}")
        if path == "dpbf16" and not kernels.dpbf16_available():
            pytest.skip(f"no AVX512_BF16 linear: {kernels.dpbf16_unavailable_reason()}")
        if path == "avx512" and not kernels.avx512_available():
            pytest.skip(f"no AVX-512F linear: {kernels.avx512_unavailable_reason()}")
        packed = path != "unpacked" and packing_supported(dtype)
        if path in ("amx", "dpbf16", "avx512", "onednn") and not packed:
            pytest.skip("oneDNN bfloat16 packing unavailable on this CPU: its linears are the [unpacked] case")
        fast, arch = _tiny_model(folder, cpu_paged_attention, dtype)
        ref, _ = _tiny_model(folder, reference_paged_attention, dtype)
        exact, _ = _tiny_model(folder, reference_paged_attention, torch.float64)
        apply_overrides(fast, cpu_op_overrides(executor_config(), dtype))   # as the engine does
        executor = CPUExecutor(fast, executor_config())
        linears = [m for role, _, _, m in fast.replaceable_modules() if role == "linear"]
        assert all(isinstance(m, PackedLinear) for m in linears) == packed
        chosen = {k for m in linears if isinstance(m, PackedLinear) for k in m.plan}
        if path in ("amx", "dpbf16", "avx512"):
            assert chosen == {path}
        elif path in ("onednn", "portable", "no_kernels") and packed:
            assert chosen == {"onednn"}
        assert isinstance(fast.layers[0].mlp, FusedMLP) == (path not in ("unfused", "no_kernels"))
        rng = np.random.default_rng(0)
        shape = (2, 48, 16, arch.num_kv_heads, arch.head_dim)
        g = torch.Generator().manual_seed(0)
        caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(arch.num_layers)]
        ref_caches = [c.clone() for c in caches]
        exact_caches = [c.double() for c in caches]
        for decodes, prefills in ((3, 3), (5, 0)):
            meta = _batch(rng, num_decodes=decodes, num_prefills=prefills, block_size=16, num_blocks=48,
                          max_blocks=6)
            T = meta.num_padded_tokens
            ids = torch.from_numpy(rng.integers(3, arch.vocab_size, size=T))
            with torch.inference_mode():
                hidden = executor.run(ModelInputs(ids, meta.positions, meta, caches, torch.zeros(1, dtype=torch.long)))
                expected = ref(ids, meta.positions, meta, ref_caches)
                got = fast.compute_logits(hidden).float()
                want = ref.compute_logits(expected).float()
                exact_logits = exact.compute_logits(exact(ids, meta.positions, meta, exact_caches))
                if executor.packed_logits is not None:   # the LM head as a packed linear
                    assert_linear_close(executor.packed_logits(hidden), hidden, fast.lm_head_weight())
            n = meta.num_actual_tokens
            err_fast, err_ref = ((x[:n].double() - exact_logits[:n]).abs() for x in (got, want))
            rms = lambda e: float(e.pow(2).mean().sqrt())  # noqa: E731
            where = f"{decodes} decodes + {prefills} prefills: |logit error| vs the plain bfloat16 model's"
            assert rms(err_fast) <= 1.5 * rms(err_ref), f"{where}: RMS {rms(err_fast):.4g} vs {rms(err_ref):.4g}"
            assert float(err_fast.max()) <= 2 * float(err_ref.max()), \
                f"{where}: max {float(err_fast.max()):.4g} vs {float(err_ref.max()):.4g}"


@pytest.mark.parametrize("H,inter", [(96, 160), (100, 100)])  # (100, 100): the vector loops' scalar tails
def test_fused_rms_norm_and_mlp_match_the_model_modules(cpu_kernels, H, inter):
    """The fused norm and the fused silu(gate) * up, like the model's own modules, within their
    roundings of float64 (the two implementations may differ from each other by 2 ulps: see
    test_cpu_kernels_fast.test_fused_add_rms_norm_matches_module); FusedMLP is the model's
    gate_up projection, that kernel and the down projection."""
    import torch.nn.functional as F

    from polyrunner.backends.cpu.fused_modules import FusedMLP, FusedRMSNorm
    from polyrunner.ops import GatedMLP, RMSNorm
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(H * 1000 + inter)
    norm = RMSNorm(H, 1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.randn(H, generator=g) * 0.3 + 1.0).to(torch.bfloat16)
    x = (torch.randn(37, H, generator=g) * 3).to(torch.bfloat16)
    xq = torch.randn(5, 4, H, generator=g).to(torch.bfloat16)  # q/k norms act on [T, heads, D]
    for inp in (x, xq):
        ref, bound = rms_norm_reference(inp, norm.weight, 1e-5)

        def check(y, ref=ref, bound=bound):
            assert_close_ulp(y, ref, torch.bfloat16, ulps=1, abs_err=bound)

        check(norm(inp))
        assert_detects_errors(check, FusedRMSNorm(norm)(inp))
    mlp = GatedMLP(H, inter).to(torch.bfloat16)
    gate_up = mlp.gate_up_proj(x)
    gate, up = gate_up.double().split(inter, dim=-1)
    # bfloat16(silu(gate)) * up rounded: silu in float32 (exp to 2^-20, an add, a division), two roundings
    want = gate * torch.sigmoid(gate) * up
    h_bound = want.abs() * (unit_roundoff(torch.bfloat16) + 2.0 ** -20 + 4 * unit_roundoff(torch.float32))

    def check_h(h):
        assert_close_ulp(h, want, torch.bfloat16, ulps=1, abs_err=h_bound)

    check_h(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])   # the module's own
    h = kernels.silu_mul(gate_up)
    assert_detects_errors(check_h, h)
    out = FusedMLP(mlp)(x)
    assert torch.equal(out, mlp.down_proj(h))
    assert_linear_close(out, h, mlp.down_proj.weight)


@pytest.mark.parametrize("dtype", ["bfloat16", "auto"])   # packed bfloat16 linears; the GGUF file quantized
def test_steps_the_pool_runs_whole_give_torch_one_thread(monkeypatch, dtype):
    """A decode step whose every linear (LM head included) runs on the pool's
    small-M kernels sets torch to one thread (OpenMP's team stays asleep instead
    of spinning on the pool's cores); a prefill step gets the full count back."""
    from polyrunner import LLM, SamplingParams
    from polyrunner.backends.cpu.executor import pool_rows, replaceable
    llm = LLM(backend="cpu", dtype=dtype, max_model_len=256, max_num_seqs=4, kv_cache_memory_bytes=32 << 20)
    ex = llm.engine.runner.executor
    linears = [getattr(parent, name) for parent, name, _ in replaceable(ex.model, "linear")]
    assert ex.pool_rows == min(pool_rows(m) for m in linears + [ex.packed_logits])
    fused = kernels.paged_attention_kernel() is not None   # fused norms, rotary and SiLU * up: bfloat16 and float32
    assert ex.graph_rows == (min([pool_rows(m) for m in linears] + [4]) if fused else 0)  # max_num_seqs 4
    if kernels.paged_attention_kernel() is not None and (dtype == "auto" or kernels.dpbf16_available()
                                                        or kernels.amx_available() or kernels.avx512_available()):
        assert ex.pool_rows > 0
    seen, granted = [], []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    if ex.governor is not None:   # what it granted each step (it re-reads the machine's load as steps run)
        grant = ex.governor.threads
        monkeypatch.setattr(ex.governor, "threads", lambda: granted.append(grant()) or granted[-1])
    ex._current_threads = None
    prompt = {"prompt_token_ids": list(range(3, 3 + 100))}   # more rows than any pool kernel takes
    llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert seen[0] == (granted[0] if ex.governor is not None else ex.threads)
    if ex.pool_rows > 0:
        assert seen[-1] == 1
    else:   # torch at one thread only where that was the count granted (a busy machine) or pinned
        assert seen[-1] != 1 or 1 in granted + [ex.threads, ex.small_threads]
