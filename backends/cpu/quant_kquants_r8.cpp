// Row-interleaved ("r8") layouts of Q6_K and Q5_K, the decode path of those types (quant_gemm.cpp
// runs them through `TypeKernels`; see its header for the r8 idea: 8 output rows per vector, scales
// in lanes, activations broadcast, no horizontal sums). Both keep the GGUF bits per weight: a
// group of 8 rows holds, per super-block of 256 inputs, exactly the bytes of the 8 rows' blocks.
// In every 32-byte vector below, byte 4r + i belongs to row r (0..7) and i (0..3) is a weight's
// place among 4 consecutive inputs.
//
// Q6_K, per super-block (8 x 210 = 1680 bytes): the 8 rows' d (float16, 16 bytes), then per block
// of 32 inputs (208 bytes): A[4] (vector k: q of inputs 4k + i, the first 16-weight sub-block, in
// bits 0-5, and bits 4-5 of the q of input 16 + 4k + i in bits 6-7), N[2] (vector c: the low 4 bits
// of the q of inputs 16 + 8c + i in the low nibbles, of 16 + 8c + 4 + i in the high ones), the 8
// rows' int8 scales of sub-block 0, then of sub-block 1 (16 bytes). Unpacking takes one `and` per
// first-half vector and four ops per second-half one.
// Q5_K, per super-block (8 x 176 = 1408 bytes): the 8 rows' d, then dmin (float16, 32 bytes), the
// 12 scale bytes of GGUF as 3 vectors (vector t: bytes 4t..4t+3 of row r in lane r: the 6-bit sc
// and mn of all 8 rows unpack with a few vector ops), then per block of 32 inputs (160 bytes):
// 4 vectors of nibbles (vector k: q of inputs 4k + i low, 16 + 4k + i high, as Q4 r8) and one
// vector of fifth bits (byte 4r + i: bit k for input 4k + i, bit 4 + k for 16 + 4k + i).
//
// Kernels: per block and activation row, integer dots per 16-weight half (Q6_K: the scale is per
// half) or per block (Q5_K), then float: acc += (d sc)_rows * dx * dot; Q6_K's offset 32 is taken
// off the integer dot (32 times the half's activation sum), Q5_K's mins go to a second accumulator
// (- (dmin mn)_rows * dx sum(q)). AVX2 `maddubs` pairs: Q6_K two products of q <= 63 per int16 lane,
// summed over two vectors (4 * 63 * 127 = 32004 at most); Q5_K four vectors (8 * 31 * 127 = 31496).
// Against the GGUF-layout kernels (quant_kquants.cpp) on Zen 3 (avx2 fma f16c), one thread: 1.2-2.4x
// (Q6_K), 2-3x (Q5_K) at 1 and 16 rows (figures in the change's description); the VNNI paths are
// compiled, not run, there.

#include "quant_common.h"

namespace prq {
namespace {
#ifdef PRQ_AVX2  // r8 runs on the SIMD paths only (`pr_quant_r8_supported`)

constexpr int Q6_UNIT = 1680, Q6_BLOCK = 208, Q5_UNIT = 1408, Q5_BLOCK = 160;

// ---- repacking (one thread: load time) -----------------------------------------------------------

// Q6_K: q (0..63) of input 32 B + l of the super-block at blk.
inline int q6(const uint8_t* blk, int B, int l) {
  const int ql = blk[64 * (B / 4) + 32 * (B & 1) + l] >> (B & 2 ? 4 : 0);
  return (ql & 0xF) | (((blk[128 + 32 * (B / 4) + l] >> (2 * (B & 3))) & 3) << 4);
}

void repack_q6k(const uint8_t* rows, int64_t row_bytes, int64_t K, uint8_t* out) {
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    uint8_t* u = out + sb * Q6_UNIT;
    for (int r = 0; r < 8; ++r) std::memcpy(u + 2 * r, rows + r * row_bytes + sb * 210 + 208, 2);
    for (int B = 0; B < 8; ++B) {
      uint8_t* p = u + 16 + B * Q6_BLOCK;
      for (int r = 0; r < 8; ++r) {
        const uint8_t* blk = rows + r * row_bytes + sb * 210;
        for (int k = 0; k < 4; ++k)
          for (int i = 0; i < 4; ++i) {
            const int a = q6(blk, B, 4 * k + i), b = q6(blk, B, 16 + 4 * k + i);
            p[32 * k + 4 * r + i] = (uint8_t)(a | ((b >> 4) << 6));
            uint8_t& n = p[128 + 32 * (k / 2) + 4 * r + i];
            n = (uint8_t)(k & 1 ? (n & 0x0F) | ((b & 0xF) << 4) : b & 0xF);
          }
        p[192 + r] = blk[192 + 2 * B];
        p[200 + r] = blk[192 + 2 * B + 1];
      }
    }
  }
}

void repack_q5k(const uint8_t* rows, int64_t row_bytes, int64_t K, uint8_t* out) {
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    uint8_t* u = out + sb * Q5_UNIT;
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = rows + r * row_bytes + sb * 176;
      std::memcpy(u + 2 * r, blk, 2);
      std::memcpy(u + 16 + 2 * r, blk + 2, 2);
      for (int t = 0; t < 3; ++t) std::memcpy(u + 32 + 32 * t + 4 * r, blk + 4 + 4 * t, 4);
      for (int j = 0; j < 8; ++j) {
        uint8_t q[32];
        for (int l = 0; l < 32; ++l)
          q[l] = (uint8_t)(((blk[48 + 32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF) | (((blk[16 + l] >> j) & 1) << 4));
        put_r8_q(u + 128 + j * Q5_BLOCK, r, q, true);
      }
    }
  }
}

// Q6_K: block p's q (0..63) as bytes, inputs 4k + i (lo[k]) and 16 + 4k + i (hi[k]).
inline void unpack_q6(const uint8_t* p, __m256i* lo, __m256i* hi) {
  const __m256i m6 = _mm256_set1_epi8(0x3F), m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i n[2] = {load32(p + 128), load32(p + 160)};
  for (int k = 0; k < 4; ++k) {
    const __m256i v = load32(p + 32 * k);
    lo[k] = _mm256_and_si256(v, m6);
    const __m256i nib = k & 1 ? _mm256_srli_epi16(n[k / 2], 4) : n[k / 2];
    hi[k] = _mm256_or_si256(_mm256_and_si256(nib, m4), _mm256_and_si256(_mm256_srli_epi16(v, 2), m30));
  }
}

// ---- dequantising (prefill steps above PREFILL_ROWS; the values of `decode`, bit for bit) ------------

void dequant_q6k(const uint8_t* g, int64_t K, float* out) {
  const float zero[8] = {};
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* u = g + sb * Q6_UNIT;
    for (int B = 0; B < 8; ++B) {
      const uint8_t* p = u + 16 + B * Q6_BLOCK;
      __m256i v[8];
      unpack_q6(p, v, v + 4);
      for (int k = 0; k < 8; ++k) v[k] = _mm256_sub_epi8(v[k], _mm256_set1_epi8(32));
      float s0[8], s1[8];
      for (int r = 0; r < 8; ++r) {
        s0[r] = h2f(u + 2 * r) * (float)(int8_t)p[192 + r];
        s1[r] = h2f(u + 2 * r) * (float)(int8_t)p[200 + r];
      }
      r8_rows(v, s0, s1, zero, zero, out + sb * 256 + B * 32, K);
    }
  }
}

void dequant_q5k(const uint8_t* g, int64_t K, float* out) {
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* u = g + sb * Q5_UNIT;
    float s[8][8], m[8][8];  // [block][row]
    for (int r = 0; r < 8; ++r) {
      uint8_t sc[12];
      for (int t = 0; t < 3; ++t) std::memcpy(sc + 4 * t, u + 32 + 32 * t + 4 * r, 4);
      for (int j = 0; j < 8; ++j) {
        int scale, mn;
        scale_min_k4(j, sc, &scale, &mn);
        s[j][r] = h2f(u + 2 * r) * (float)scale;
        m[j][r] = h2f(u + 16 + 2 * r) * (float)mn;
      }
    }
    for (int j = 0; j < 8; ++j) {
      __m256i v[8];
      load_r8_q(u + 128 + j * Q5_BLOCK, true, v, v + 4);
      r8_rows(v, s[j], s[j], m[j], m[j], out + sb * 256 + j * 32, K);
    }
  }
}

// ---- kernels --------------------------------------------------------------------------------------

template <int ISA, int MB>
void group_q6k(const uint8_t* gp, int64_t nb, bool, const QRow* a, float (*out)[8]) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* u = gp + sb * Q6_UNIT;
    const __m256 d = load_f16x8(u);
    for (int B = 0; B < 8; ++B) {
      const uint8_t* p = u + 16 + B * Q6_BLOCK;
      prefetch(p, Q6_BLOCK);
      __m256i lo[4], hi[4];
      unpack_q6(p, lo, hi);
      const __m256 s0 = scales8(p + 192, d, true), s1 = scales8(p + 200, d, true);
      const int64_t b = sb * 8 + B;
      for (int m = 0; m < MB; ++m) {
        const int8_t* x = a[m].q + b * 32;
        const __m256i i0 = _mm256_sub_epi32(dot16<ISA, 2>(lo, x), _mm256_set1_epi32(32 * a[m].qsum16[2 * b]));
        const __m256i i1 = _mm256_sub_epi32(dot16<ISA, 2>(hi, x + 16), _mm256_set1_epi32(32 * a[m].qsum16[2 * b + 1]));
        const __m256 dx = _mm256_set1_ps(a[m].d[b]);
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(s0, dx), _mm256_cvtepi32_ps(i0), acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(s1, dx), _mm256_cvtepi32_ps(i1), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

template <int ISA, int MB>
void group_q5k(const uint8_t* gp, int64_t nb, bool, const QRow* a, float (*out)[8]) {
  __m256 acc[MB], off[MB];
  for (int m = 0; m < MB; ++m) acc[m] = off[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi8(0x3F), m30 = _mm256_set1_epi8(0x30),
                mff = _mm256_set1_epi32(0xFF);
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* u = gp + sb * Q5_UNIT;
    const __m256 d = load_f16x8(u), dmin = load_f16x8(u + 16);
    // the 6-bit sc / mn of sub-blocks 0-3 and 4-7, byte j % 4 of lane r (Q4_K's packing, 8 rows at once)
    const __m256i v0 = load32(u + 32), v1 = load32(u + 64), v2 = load32(u + 96);
    const __m256i sc[2] = {_mm256_and_si256(v0, m6),
                           _mm256_or_si256(_mm256_and_si256(v2, m4), _mm256_and_si256(_mm256_srli_epi16(v0, 2), m30))};
    const __m256i mn[2] = {_mm256_and_si256(v1, m6),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v2, 4), m4),
                                           _mm256_and_si256(_mm256_srli_epi16(v1, 2), m30))};
    for (int j = 0; j < 8; ++j) {
      const uint8_t* p = u + 128 + j * Q5_BLOCK;
      prefetch(p, Q5_BLOCK);
      const __m256 s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(sc[j / 4], 8 * (j % 4)), mff)));
      const __m256 mo = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(mn[j / 4], 8 * (j % 4)), mff)));
      __m256i lo[4], hi[4];
      load_r8_q(p, true, lo, hi);
      const int64_t b = sb * 8 + j;
      for (int m = 0; m < MB; ++m) {
        const int8_t* x = a[m].q + b * 32;
        const __m256i t = _mm256_add_epi32(dot16<ISA, 4>(lo, x), dot16<ISA, 4>(hi, x + 16));
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a[m].d[b])), _mm256_cvtepi32_ps(t), acc[m]);
        off[m] = _mm256_fmadd_ps(mo, _mm256_set1_ps(-a[m].s[b]), off[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out[m], _mm256_add_ps(acc[m], off[m]));
}

template <int QT, int MB>
GroupFn group_isa(int isa) {
  switch (isa) {
#ifdef PRQ_AVX512VNNI
    case AVX512VNNI: return QT == Q6_K ? group_q6k<AVX512VNNI, MB> : group_q5k<AVX512VNNI, MB>;
#endif
#ifdef PRQ_AVXVNNI
    case AVXVNNI: return QT == Q6_K ? group_q6k<AVXVNNI, MB> : group_q5k<AVXVNNI, MB>;
#endif
    case AVX2: return QT == Q6_K ? group_q6k<AVX2, MB> : group_q5k<AVX2, MB>;
  }
  return nullptr;
}
template <int QT>
GroupFn group_pick(int isa, int mb) {
  switch (mb) {
    case 1: return group_isa<QT, 1>(isa);
    case 2: return group_isa<QT, 2>(isa);
    case 3: return group_isa<QT, 3>(isa);
    case 4: return group_isa<QT, 4>(isa);
  }
  return nullptr;
}
#endif  // PRQ_AVX2

}  // namespace

R8Kernels kquant_r8(int qt) {
#ifdef PRQ_AVX2
  if (qt == Q6_K) return {256, Q6_UNIT, group_pick<Q6_K>, repack_q6k, dequant_q6k};
  if (qt == Q5_K) return {256, Q5_UNIT, group_pick<Q5_K>, repack_q5k, dequant_q5k};
#endif
  (void)qt;
  return {0, 0, nullptr, nullptr, nullptr};
}

}  // namespace prq
