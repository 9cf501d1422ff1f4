"""GGUF blocks for the CPU quantized-kernel tests: random valid blocks of every type the
kernels run, and, per weight, the parts a kernel sums (for the float32 error bounds).

`parts(qtype, blocks)` decodes each weight as w = S * (v - o) - m (S the weight's float
scale, v its stored integer, or the table value of the IQ4 types, o the type's constant
offset, m its min / offset term) with numpy, independently of the kernels; it is checked
against `gguf.quants.dequantize` (tests/test_cpu_quant_kernels.py), so the bounds below
rest on the format as llama.cpp's package decodes it. A kernel adds up, per weight and
activation, at most |S| * |v| + |S| * o + |m| times |x|: `magnitude_weights`.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# float16 scale fields (byte offsets in a block): set to sane values in random blocks
F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
    "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,), "IQ4_XS": (0,),
}
IQ4_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float64)
OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q3_K": 4}  # o, per type (0 for the others)


def block_shape(qtype: str) -> tuple[int, int]:
    """(weights, bytes) per block."""
    return gguf.GGML_QUANT_SIZES[Q[qtype]]


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """uint8 `[rows, row_bytes]`: random bytes (every bit pattern of the integers and packed
    scales, Q8_0's -128 included) with float16 scales in [0.002, 0.05]."""
    block, size = block_shape(qtype)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(0.002, 0.05, size=(rows, cols // block)).astype(np.float16)
        data[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def centered_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """`random_blocks` whose weights have about zero mean per sub-block, as a quantizer's would:
    the types with a min or offset field (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) get it set to the middle of
    their integer range times the scale (Q4_K / Q5_K: dmin = 7.5 d / 15.5 d and mn_j = sc_j; Q2_K:
    dmin = 1.5 d and mn_s = sc_s); random mins make every weight of a sub-block share a large
    offset, so that int8 activations round a tiny random model's logits by whole nats."""
    blocks = random_blocks(rng, qtype, rows, cols)
    block, size = block_shape(qtype)
    b = blocks.reshape(rows, -1, size)

    def put(off: int, value: np.ndarray) -> None:
        b[..., off:off + 2] = value.astype(np.float16)[..., None].view(np.uint8)

    if qtype in ("Q4_1", "Q5_1"):
        put(2, -_f16(b, 0) * (7.5 if qtype == "Q4_1" else 15.5))
    elif qtype in ("Q4_K", "Q5_K"):
        put(2, _f16(b, 0) * (7.5 if qtype == "Q4_K" else 15.5))
        b[..., 8:12] = b[..., 4:8]                       # mn_j = sc_j (j < 4), and bits 4-5 of j + 4's
        b[..., 12:16] = (b[..., 12:16] & 0x0F) * 0x11    # the low 4 bits of mn_{j+4} = sc_{j+4}'s
    elif qtype == "Q2_K":
        put(82, _f16(b, 80) * 1.5)
        b[..., :16] = (b[..., :16] & 0x0F) * 0x11
    return blocks


def _f16(b: np.ndarray, off: int) -> np.ndarray:
    return b[..., off:off + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: low nibbles, then high nibbles."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.float64)


def _bits(b: np.ndarray, n: int) -> np.ndarray:
    """[..., n / 8] bytes -> [..., n] bits, little-endian."""
    return np.unpackbits(b, axis=-1, bitorder="little")[..., :n].astype(np.float64)


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: [..., 12] packed bytes -> (sc, mn) [..., 8]."""
    a, m, h = sc[..., 0:4].astype(np.int64), sc[..., 4:8].astype(np.int64), sc[..., 8:12].astype(np.int64)
    scale = np.concatenate([a & 63, (h & 0xF) | ((a >> 6) << 4)], -1)
    mins = np.concatenate([m & 63, (h >> 4) | ((m >> 6) << 4)], -1)
    return scale.astype(np.float64), mins.astype(np.float64)


def parts(qtype: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(S, v, m), float64 `[N, K]` each, with w = S * (v - OFFSET[qtype]) - m."""
    N = blocks.shape[0]
    block, size = block_shape(qtype)
    b = blocks.reshape(N, -1, size)
    nb = b.shape[1]
    zero = np.zeros((N, nb, block))

    def per(x: np.ndarray, width: int) -> np.ndarray:  # [N, nb, block / width] -> per weight
        return np.repeat(x, width, axis=-1)

    if qtype == "Q8_0":
        S, v, m = per(_f16(b, 0)[..., None], 32), b[..., 2:].view(np.int8).astype(np.float64), zero
    elif qtype in ("Q4_0", "Q4_1", "IQ4_NL"):
        qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
        S, v = per(_f16(b, 0)[..., None], 32), _nibbles32(qs)
        m = -per(_f16(b, 2)[..., None], 32) if qtype == "Q4_1" else zero
        if qtype == "IQ4_NL":
            v = IQ4_TABLE[v.astype(np.int64)]
    elif qtype in ("Q5_0", "Q5_1"):
        qh = b[..., 4:8] if qtype == "Q5_1" else b[..., 2:6]
        S, v = per(_f16(b, 0)[..., None], 32), _nibbles32(b[..., 8:] if qtype == "Q5_1" else b[..., 6:])
        v = v + 16 * _bits(qh, 32)
        m = -per(_f16(b, 2)[..., None], 32) if qtype == "Q5_1" else zero
    elif qtype in ("Q4_K", "Q5_K"):
        sc, mn = _k4_scales(b[..., 4:16])
        qs = b[..., 16:] if qtype == "Q4_K" else b[..., 48:]
        v = np.stack([qs.reshape(N, nb, 4, 32) & 0xF, qs.reshape(N, nb, 4, 32) >> 4], 3).reshape(N, nb, 256)
        v = v.astype(np.float64)
        if qtype == "Q5_K":  # bit j of qh[l] for weight 32 j + l
            v = v + 16 * _bits(b[..., 16:48], 256).reshape(N, nb, 32, 8).swapaxes(-1, -2).reshape(N, nb, 256)
        S, m = per(_f16(b, 0)[..., None] * sc, 32), per(_f16(b, 2)[..., None] * mn, 32)
    elif qtype == "Q6_K":
        ql, qh = b[..., :128].reshape(N, nb, 2, 2, 32), b[..., 128:192].reshape(N, nb, 2, 1, 32)
        low = np.stack([ql & 0xF, ql >> 4], 3).reshape(N, nb, 2, 4, 32)  # [half, (nibble, part), l]
        high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        v = (low | (high << 4)).reshape(N, nb, 256).astype(np.float64)
        S, m = per(_f16(b, 208)[..., None] * b[..., 192:208].view(np.int8), 16), zero
    elif qtype in ("Q3_K", "Q2_K"):
        qs = b[..., 32:96] if qtype == "Q3_K" else b[..., 16:80]
        v = (qs.reshape(N, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
        v = v.reshape(N, nb, 256).astype(np.float64)
        if qtype == "Q3_K":  # + 4 where bit j of hmask[l] is set, for weight 32 j + l
            v = v + 4 * _bits(b[..., :32], 256).reshape(N, nb, 32, 8).swapaxes(-1, -2).reshape(N, nb, 256)
            raw = b[..., 96:108].astype(np.int64)
            i = np.arange(16)
            low = np.where(i < 8, raw[..., i % 8] & 0xF, raw[..., i % 8] >> 4)
            high = (raw[..., 8 + i % 4] >> (2 * (i // 4))) & 3
            S, m = per(_f16(b, 108)[..., None] * ((low | (high << 4)) - 32), 16), zero
        else:
            S = per(_f16(b, 80)[..., None] * (b[..., :16] & 0xF), 16)
            m = per(_f16(b, 82)[..., None] * (b[..., :16] >> 4), 16)
    elif qtype == "IQ4_XS":
        raw_h = b[..., 2:4].copy().view(np.uint16)[..., 0].astype(np.int64)
        j = np.arange(8)
        ls = ((b[..., 4 + j // 2].astype(np.int64) >> (4 * (j % 2))) & 0xF) | (((raw_h[..., None] >> (2 * j)) & 3) << 4)
        S = per(_f16(b, 0)[..., None] * (ls - 32), 32)
        v = IQ4_TABLE[_nibbles32(b[..., 8:].reshape(N, nb, 8, 16)).astype(np.int64)].reshape(N, nb, 256)
        m = zero
    else:
        raise ValueError(f"no decoder for {qtype}")
    return S.reshape(N, -1), v.reshape(N, -1), m.reshape(N, -1)


def magnitude_weights(qtype: str, blocks: np.ndarray) -> np.ndarray:
    """float64 `[N, K]`: per weight, |S| * (|v| + o) + |m|, the sum of the magnitudes of the parts
    a kernel may add up for it (its offset and min terms separately from S * v, which may cancel)."""
    S, v, m = parts(qtype, blocks)
    return np.abs(S) * (np.abs(v) + OFFSET.get(qtype, 0)) + np.abs(m)


def scaled_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int, weight_std: float) -> np.ndarray:
    """uint8 `[rows, row_bytes]` of valid random blocks scaled to `weight_std` (F32: float values)."""
    if qtype == "F32":
        return (rng.standard_normal((rows, cols)) * weight_std).astype(np.float32)
    blocks = centered_blocks(rng, qtype, rows, cols)
    sample = blocks[: min(rows, 16)]
    factor = weight_std / float(gguf.quants.dequantize(sample, Q[qtype]).std())
    size = gguf.GGML_QUANT_SIZES[Q[qtype]][1]
    view = blocks.reshape(rows, -1, size)
    for off in F16_FIELDS[qtype]:
        scales = view[:, :, off:off + 2].copy().view(np.float16).astype(np.float32) * factor
        view[:, :, off:off + 2] = scales.astype(np.float16).view(np.uint8)
    return blocks
