// Row-interleaved ("r8") layouts of Q5_0, Q5_1, IQ4_NL and IQ4_XS, the decode path of those types
// (quant_gemm.cpp runs them through `TypeKernels`; see its header for the r8 idea). Each keeps the
// GGUF bits per weight: a group of 8 rows holds, per unit, exactly the bytes of the 8 rows' blocks.
// Values use the r8 blocks of 4- and 5-bit values of quant_common.h (4 nibble vectors, then for
// Q5_0 / Q5_1 a vector of fifth bits; byte 4r + i of a vector belongs to row r). Per unit:
//   Q5_0   (32 inputs, 176 bytes)  values (160), the 8 rows' d (float16)
//   Q5_1   (32 inputs, 192 bytes)  values (160), d, m (float16)
//   IQ4_NL (32 inputs, 144 bytes)  4-bit indices (128), d
//   IQ4_XS (256 inputs, 1088 bytes) d (16), scales_l (lane r: row r's 4 bytes, 32), scales_h (row r's
//          uint16, 16), then per block of 32 the 4-bit indices (128)
// Kernels: per block and activation row an integer dot of 8 lanes (rows), then float: acc +=
// (scale)_rows * dx * dot; Q5_0 / Q5_1's offsets (-16 d, m) times the activations' block sum go to
// a second accumulator. Q5 AVX2 `maddubs`: four vectors summed per int16 lane, 8 * 31 * 127 = 31496
// at most. IQ4: the table value T[q] by `pshufb`, |T[q]| against x with T[q]'s sign (Q8_0's trick),
// each `maddubs` widened at once (2 * 127 * 127 = 32258: two would not fit int16).

#include "quant_common.h"

namespace prq {
namespace {
#ifdef PRQ_AVX2  // r8 runs on the SIMD paths only (`pr_quant_r8_supported`)

constexpr int XS_UNIT = 1088, XS_HEAD = 64;

template <int QT>
constexpr int unit_bytes() {
  return QT == Q5_0 ? 176 : QT == Q5_1 ? 192 : QT == IQ4_NL ? 144 : XS_UNIT;
}

// ---- repacking (one thread: load time) and dequantising (the values of gguf, bit for bit) ----------

template <int QT>
void repack(const uint8_t* rows, int64_t row_bytes, int64_t K, uint8_t* out) {
  constexpr bool fifth = QT == Q5_0 || QT == Q5_1;
  uint8_t q[32];
  if (QT == IQ4_XS) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      uint8_t* u = out + sb * XS_UNIT;
      for (int r = 0; r < 8; ++r) {
        const uint8_t* blk = rows + r * row_bytes + sb * 136;
        std::memcpy(u + 2 * r, blk, 2);            // d
        std::memcpy(u + 16 + 4 * r, blk + 4, 4);   // scales_l
        std::memcpy(u + 48 + 2 * r, blk + 2, 2);   // scales_h
        for (int j = 0; j < 8; ++j) {
          for (int l = 0; l < 32; ++l) q[l] = (blk[8 + 16 * j + l % 16] >> (4 * (l / 16))) & 0xF;
          put_r8_q(u + XS_HEAD + 128 * j, r, q, false);
        }
      }
    }
    return;
  }
  constexpr int bb = QT == Q5_0 ? 22 : QT == Q5_1 ? 24 : 18, qs = QT == Q5_0 ? 6 : QT == Q5_1 ? 8 : 2;
  constexpr int dat = fifth ? 160 : 128;  // where the scales start in a unit
  for (int64_t b = 0; b < K / 32; ++b) {
    uint8_t* u = out + b * unit_bytes<QT>();
    for (int r = 0; r < 8; ++r) {
      const uint8_t* blk = rows + r * row_bytes + b * bb;
      for (int l = 0; l < 32; ++l) {
        q[l] = (blk[qs + l % 16] >> (4 * (l / 16))) & 0xF;
        if (fifth) q[l] |= ((blk[qs - 4 + l / 8] >> (l % 8)) & 1) << 4;
      }
      put_r8_q(u, r, q, fifth);
      std::memcpy(u + dat + 2 * r, blk, 2);                            // d
      if (QT == Q5_1) std::memcpy(u + dat + 16 + 2 * r, blk + 2, 2);  // m
    }
  }
}

// A block's values (lo, hi as `load_r8_q` gives them) as the signed int8 the weights multiply:
// q - 16 (Q5_0), q (Q5_1), T[q] (IQ4).
template <int QT>
inline void signed_values(__m256i* v) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
  for (int k = 0; k < 8; ++k)
    v[k] = QT == Q5_0 ? _mm256_sub_epi8(v[k], _mm256_set1_epi8(16)) : QT == Q5_1 ? v[k] : _mm256_shuffle_epi8(table, v[k]);
}

template <int QT>
void dequant(const uint8_t* g, int64_t K, float* out) {
  constexpr bool fifth = QT == Q5_0 || QT == Q5_1;
  const float zero[8] = {};
  float s[8], m[8];
  __m256i v[8];
  if (QT == IQ4_XS) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* u = g + sb * XS_UNIT;
      for (int j = 0; j < 8; ++j) {
        for (int r = 0; r < 8; ++r) {
          uint16_t sh;
          std::memcpy(&sh, u + 48 + 2 * r, 2);
          const int ls = ((u[16 + 4 * r + j / 2] >> (4 * (j & 1))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
          s[r] = h2f(u + 2 * r) * (float)(ls - 32);
        }
        load_r8_q(u + XS_HEAD + 128 * j, false, v, v + 4);
        signed_values<QT>(v);
        r8_rows(v, s, s, zero, zero, out + sb * 256 + 32 * j, K);
      }
    }
    return;
  }
  constexpr int dat = fifth ? 160 : 128;
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* u = g + b * unit_bytes<QT>();
    for (int r = 0; r < 8; ++r) {
      s[r] = h2f(u + dat + 2 * r);
      m[r] = QT == Q5_1 ? -h2f(u + dat + 16 + 2 * r) : 0.f;  // w = d q + m = s q - (-m)
    }
    load_r8_q(u, fifth, v, v + 4);
    signed_values<QT>(v);
    r8_rows(v, s, s, m, m, out + b * 32, K);
  }
}

// ---- kernels --------------------------------------------------------------------------------------

// IQ4: 8 int32 lanes (rows) = sum over 16 inputs of T[q] (t[k], k = 0..3: inputs 4k..4k+3; u = |t|)
// times x; x takes t's sign. AVX2 widens each `maddubs` (up to 2 * 127 * 127 per int16 lane).
template <int ISA>
inline __m256i dot16_signed(const __m256i* u, const __m256i* t, const int8_t* x) {
  __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int k = 0; k < 4; ++k) {
    const __m256i xs = _mm256_sign_epi8(bcast4(x + 4 * k), t[k]);
    if (ISA == AVX2)
      s[k & 1] = _mm256_add_epi32(s[k & 1], _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], xs), _mm256_set1_epi16(1)));
    else
      s[k & 1] = PRQ_DPBUSD8(ISA, s[k & 1], u[k], xs);
  }
  return _mm256_add_epi32(s[0], s[1]);
}

// Q5_0, Q5_1, IQ4_NL: one unit per block of 32 inputs.
template <int ISA, int QT, int MB>
void group32(const uint8_t* gp, int64_t nb, const QRow* a, float (*out)[8]) {
  constexpr bool fifth = QT == Q5_0 || QT == Q5_1;
  constexpr int dat = fifth ? 160 : 128;
  __m256 acc[MB], off[MB];
  for (int m = 0; m < MB; ++m) acc[m] = off[m] = _mm256_setzero_ps();
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = gp + b * unit_bytes<QT>();
    prefetch(p, unit_bytes<QT>());
    __m256i lo[4], hi[4];
    load_r8_q(p, fifth, lo, hi);
    const __m256 d = load_f16x8(p + dat);
    if (QT == IQ4_NL) {
      __m256i ulo[4], uhi[4];
      for (int k = 0; k < 4; ++k) {
        lo[k] = _mm256_shuffle_epi8(table, lo[k]);
        hi[k] = _mm256_shuffle_epi8(table, hi[k]);
        ulo[k] = _mm256_sign_epi8(lo[k], lo[k]);
        uhi[k] = _mm256_sign_epi8(hi[k], hi[k]);
      }
      for (int m = 0; m < MB; ++m) {
        const int8_t* x = a[m].q + b * 32;
        const __m256i t = _mm256_add_epi32(dot16_signed<ISA>(ulo, lo, x), dot16_signed<ISA>(uhi, hi, x + 16));
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[m].d[b])), _mm256_cvtepi32_ps(t), acc[m]);
      }
      continue;
    }
    const __m256 mo = QT == Q5_1 ? load_f16x8(p + dat + 16) : _mm256_mul_ps(d, _mm256_set1_ps(-16.f));
    for (int m = 0; m < MB; ++m) {
      const int8_t* x = a[m].q + b * 32;
      const __m256i t = _mm256_add_epi32(dot16<ISA, 4>(lo, x), dot16<ISA, 4>(hi, x + 16));
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[m].d[b])), _mm256_cvtepi32_ps(t), acc[m]);
      off[m] = _mm256_fmadd_ps(mo, _mm256_set1_ps(a[m].s[b]), off[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out[m], _mm256_add_ps(acc[m], off[m]));
}

// IQ4_XS: per super-block the 8 rows' d and 6-bit block scales ls (w = d (ls - 32) T[q]).
template <int ISA, int MB>
void group_xs(const uint8_t* gp, int64_t nb, const QRow* a, float (*out)[8]) {
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* u = gp + sb * XS_UNIT;
    const __m256 d = load_f16x8(u);
    const __m256i sl = load32(u + 16), sh = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 48)));
    for (int j = 0; j < 8; ++j) {
      const uint8_t* p = u + XS_HEAD + 128 * j;
      prefetch(p, 128);
      const __m256i ls = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(sl, 4 * j), _mm256_set1_epi32(0xF)),
                                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(sh, 2 * j), _mm256_set1_epi32(3)), 4));
      const __m256 s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))));
      __m256i lo[4], hi[4], ulo[4], uhi[4];
      load_r8_q(p, false, lo, hi);
      for (int k = 0; k < 4; ++k) {
        lo[k] = _mm256_shuffle_epi8(table, lo[k]);
        hi[k] = _mm256_shuffle_epi8(table, hi[k]);
        ulo[k] = _mm256_sign_epi8(lo[k], lo[k]);
        uhi[k] = _mm256_sign_epi8(hi[k], hi[k]);
      }
      const int64_t b = sb * 8 + j;
      for (int m = 0; m < MB; ++m) {
        const int8_t* x = a[m].q + b * 32;
        const __m256i t = _mm256_add_epi32(dot16_signed<ISA>(ulo, lo, x), dot16_signed<ISA>(uhi, hi, x + 16));
        acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a[m].d[b])), _mm256_cvtepi32_ps(t), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

template <int QT>
struct Groups {  // pick_kernel's family: the r8 group kernels of QT (no scalar path)
  template <int ISA, int MB>
  static constexpr GroupFn simd() {
    if constexpr (QT == IQ4_XS)
      return group_xs<ISA, MB>;
    else
      return group32<ISA, QT, MB>;
  }
  template <int MB>
  static constexpr GroupFn scalar() { return nullptr; }
};

template <int QT>
constexpr R8Kernels r8() {
  return {QT == IQ4_XS ? 256 : 32, unit_bytes<QT>(), pick_kernel<Groups<QT>>, repack<QT>, dequant<QT>};
}
#endif  // PRQ_AVX2

}  // namespace

R8Kernels small_r8(int qt) {
  switch (qt) {
#ifdef PRQ_AVX2
    case Q5_0: return r8<Q5_0>();
    case Q5_1: return r8<Q5_1>();
    case IQ4_NL: return r8<IQ4_NL>();
    case IQ4_XS: return r8<IQ4_XS>();
#endif
  }
  return {0, 0, nullptr, nullptr, nullptr};
}

}  // namespace prq
