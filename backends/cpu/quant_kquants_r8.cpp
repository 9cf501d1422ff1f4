// Row-interleaved ("r8") layouts of Q6_K, Q5_K and Q4_K, the decode path of those types (quant_gemm.cpp
// runs them through `R8Kernels`; see its header for the r8 idea: 8 output rows per vector, scales
// in lanes, activations broadcast, no horizontal sums). All keep the GGUF bits per weight: a
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
// Q4_K, per super-block (8 x 144 = 1152 bytes): Q5_K's without the fifth bits: d, dmin, the scale
// vectors (128 bytes), then per block of 32 inputs the 4 vectors of nibbles (128 bytes). (Its first
// r8 layout stored d sc and -dmin mn as float32 per row and block: 24 bytes per 32 weights, 1.33x
// the file, which the process then held resident.)
//
// Kernels: per block and activation row, integer dots per 16-weight half (Q6_K: the scale is per
// half) or per block (Q5_K, Q4_K), then float: acc += (d sc)_rows * dx * dot; Q6_K's offset 32 is taken
// off the integer dot (32 times the half's activation sum). Q5_K / Q4_K: per super-block the 8 rows'
// sc and mn are unpacked once (to bytes, sub-block-major), per block converted to float (no product
// with d: two super-block sums, sc dx dot and mn dx sum(q), are multiplied by the rows' d and dmin
// at the super-block's end), so a block costs 4 vector ops more than with float32 scales stored,
// for 25% fewer bytes. AVX2 `maddubs` pairs: Q6_K two products of q <= 63 per int16 lane,
// summed over two vectors (4 * 63 * 127 = 32004 at most); Q5_K four vectors (8 * 31 * 127 = 31496).
// Q4_K against its float32-scale layout, one thread on Zen 3: about as fast with the weights in L3,
// faster from DRAM (fewer bytes); figures in the change's description. Against the GGUF-layout kernels (quant_kquants.cpp) on Zen 3 (avx2 fma f16c), one thread: 1.2-2.4x
// (Q6_K), 2-3x (Q5_K) at 1 and 16 rows (figures in the change's description); the VNNI paths are
// compiled, not run, there.

#include "quant_common.h"

namespace prq {
namespace {
#ifdef PRQ_AVX2  // r8 runs on the SIMD paths only (`pr_quant_r8_supported`)

constexpr int Q6_UNIT = 1680, Q6_BLOCK = 208;
// Q5_K and Q4_K: one layout but for the fifth bits (a block of 32 inputs: 160 bytes, or Q4_K's 128)
template <int QT>
constexpr int unit_bytes() { return QT == Q5_K ? 1408 : 1152; }
template <int QT>
constexpr int block_bytes() { return QT == Q5_K ? 160 : 128; }
constexpr int K45_HEAD = 128;  // d, dmin, the 12 scale bytes

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

// Q5_K (176 bytes a super-block: d, dmin, 12 scale bytes, 32 of fifth bits, 128 of nibbles) and
// Q4_K (144: d, dmin, 12 scale bytes, 128 of nibbles).
template <int QT>
void repack_k45(const uint8_t* rows, int64_t row_bytes, int64_t K, uint8_t* out) {
  constexpr bool fifth = QT == Q5_K;
  constexpr int sb_bytes = fifth ? 176 : 144, qs = fifth ? 48 : 16;
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    uint8_t* u = out + sb * unit_bytes<QT>();
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = rows + r * row_bytes + sb * sb_bytes;
      std::memcpy(u + 2 * r, blk, 2);
      std::memcpy(u + 16 + 2 * r, blk + 2, 2);
      for (int t = 0; t < 3; ++t) std::memcpy(u + 32 + 32 * t + 4 * r, blk + 4 + 4 * t, 4);
      for (int j = 0; j < 8; ++j) {
        uint8_t q[32];
        for (int l = 0; l < 32; ++l)
          q[l] = (uint8_t)(((blk[qs + 32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF) |
                           (fifth ? ((blk[16 + l] >> j) & 1) << 4 : 0));
        put_r8_q(u + K45_HEAD + j * block_bytes<QT>(), r, q, fifth);
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

template <int QT>
void dequant_k45(const uint8_t* g, int64_t K, float* out) {
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* u = g + sb * unit_bytes<QT>();
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
      load_r8_q(u + K45_HEAD + j * block_bytes<QT>(), QT == Q5_K, v, v + 4);
      r8_rows(v, s[j], s[j], m[j], m[j], out + sb * 256 + j * 32, K);
    }
  }
}

// ---- kernels --------------------------------------------------------------------------------------

template <int ISA, int MB>
void group_q6k(const uint8_t* gp, int64_t nb, const QRow* a, float (*out)[8]) {
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

// Q5_K and Q4_K: w = (d sc)_row q - (dmin mn)_row. tr, perm: the scale vectors (lane r: row r's bytes
// of sub-blocks 4h..4h+3) to bytes 8 j + r (`pshufb` per 128-bit half, then its dwords interleaved).
template <int ISA, int QT, int MB>
void group_k45(const uint8_t* gp, int64_t nb, const QRow* a, float (*out)[8]) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi8(0x3F), m30 = _mm256_set1_epi8(0x30);
  const __m256i tr = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5, 9, 13, 2,
                                      6, 10, 14, 3, 7, 11, 15);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* u = gp + sb * unit_bytes<QT>();
    const __m256i v0 = load32(u + 32), v1 = load32(u + 64), v2 = load32(u + 96);
    const __m256i sc[2] = {_mm256_and_si256(v0, m6),
                           _mm256_or_si256(_mm256_and_si256(v2, m4), _mm256_and_si256(_mm256_srli_epi16(v0, 2), m30))};
    const __m256i mn[2] = {_mm256_and_si256(v1, m6),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v2, 4), m4),
                                           _mm256_and_si256(_mm256_srli_epi16(v1, 2), m30))};
    alignas(32) uint8_t scb[64], mnb[64];
    for (int h = 0; h < 2; ++h) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(scb + 32 * h), _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(sc[h], tr), perm));
      _mm256_store_si256(reinterpret_cast<__m256i*>(mnb + 32 * h), _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(mn[h], tr), perm));
    }
    __m256 ts[MB], tm[MB];
    for (int m = 0; m < MB; ++m) ts[m] = tm[m] = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      const uint8_t* p = u + K45_HEAD + j * block_bytes<QT>();
      prefetch(p, block_bytes<QT>());
      const __m256 s = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scb + 8 * j))));
      const __m256 mo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mnb + 8 * j))));
      __m256i lo[4], hi[4];
      load_r8_q(p, QT == Q5_K, lo, hi);
      const int64_t b = sb * 8 + j;
      for (int m = 0; m < MB; ++m) {
        const int8_t* x = a[m].q + b * 32;
        const __m256i t = QT == Q5_K ? _mm256_add_epi32(dot16<ISA, 4>(lo, x), dot16<ISA, 4>(hi, x + 16))
                                     : block_dot4bit<ISA>(lo, hi, x);
        ts[m] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a[m].d[b])), _mm256_cvtepi32_ps(t), ts[m]);
        tm[m] = _mm256_fmadd_ps(mo, _mm256_set1_ps(a[m].s[b]), tm[m]);
      }
    }
    const __m256 d = load_f16x8(u), dmin = load_f16x8(u + 16);
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_fnmadd_ps(dmin, tm[m], _mm256_fmadd_ps(d, ts[m], acc[m]));
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

template <int QT>
struct Groups {  // pick_kernel's family: the r8 group kernels of QT (no scalar path)
  template <int ISA, int MB>
  static constexpr GroupFn simd() {
    if constexpr (QT == Q6_K)
      return group_q6k<ISA, MB>;
    else
      return group_k45<ISA, QT, MB>;
  }
  template <int MB>
  static constexpr GroupFn scalar() { return nullptr; }
};
#endif  // PRQ_AVX2

}  // namespace

R8Kernels kquant_r8(int qt) {
#ifdef PRQ_AVX2
  if (qt == Q6_K) return {256, Q6_UNIT, pick_kernel<Groups<Q6_K>>, repack_q6k, dequant_q6k};
  if (qt == Q5_K) return {256, unit_bytes<Q5_K>(), pick_kernel<Groups<Q5_K>>, repack_k45<Q5_K>, dequant_k45<Q5_K>};
  if (qt == Q4_K) return {256, unit_bytes<Q4_K>(), pick_kernel<Groups<Q4_K>>, repack_k45<Q4_K>, dequant_k45<Q4_K>};
#endif
  (void)qt;
  return {0, 0, nullptr, nullptr, nullptr};
}

}  // namespace prq
