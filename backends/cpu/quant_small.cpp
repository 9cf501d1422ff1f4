// Q5_0, Q5_1, IQ4_NL and IQ4_XS for the quantized linear of quant_gemm.cpp (through
// `TypeKernels`; the activations, the driver and the threads are its). Blocks as llama.cpp's
// ggml-common.h lays them out (bytes; weight l of a block of 32 takes nibble l / 16 of qs[l % 16]):
//   Q5_0   (22)  d f16, qh[4] (bit l: q += 16), qs[16]       w = d (q - 16), q 0..31
//   Q5_1   (24)  d f16, m f16, qh[4], qs[16]                 w = d q + m
//   IQ4_NL (18)  d f16, qs[16]                               w = d T[q], q 0..15
//   IQ4_XS (136) per 256: d f16, scales_h u16, scales_l[4], qs[128] (16 per block of 32)
//                block j: w = d (ls_j - 32) T[q], ls_j = nibble j % 2 of scales_l[j / 2] | bits 2j of scales_h << 4
// T: llama.cpp's non-linear 4-bit table `kvalues_iq4nl` (int8, -127..113).
//
// SIMD (GGUF layout): Q5 types as Q4_0 / Q4_1 with the fifth bit spread from qh (q <= 31: 31 * 127 * 2
// per int16 pair); the offsets through the activations' block sums, as Q4_0 / Q4_1. IQ4: T[q] by
// `pshufb`, then the sign trick of Q8_0 (|T[q]| with x taking T[q]'s sign, |T[q]| <= 127: at most
// 127 * 127 * 2 = 32258 per int16 pair).

#include "quant_common.h"

namespace prq {
namespace {


template <int QT>
constexpr int bytes_of() {
  return QT == Q5_0 ? 22 : QT == Q5_1 ? 24 : QT == IQ4_NL ? 18 : 136;
}

// ---- GGUF blocks as integers (`DecodeFn`: w = s[h] v - m[h], gguf's float32 operations) ----------

template <int QT>
void decode(const uint8_t* row, int64_t b, int16_t* v, float* s, float* m) {
  m[0] = m[1] = 0.f;
  if (QT == IQ4_XS) {
    const uint8_t* blk = row + (b / 8) * 136;
    const int j = (int)(b % 8);
    const int ls = ((blk[4 + j / 2] >> (4 * (j & 1))) & 0xF) | (((blk[2 + j / 4] >> (2 * (j % 4))) & 3) << 4);
    s[0] = s[1] = h2f(blk) * (float)(ls - 32);
    const uint8_t* qs = blk + 8 + 16 * j;
    for (int l = 0; l < 32; ++l) v[l] = IQ4_VALUES[(qs[l % 16] >> (4 * (l / 16))) & 0xF];
    return;
  }
  const uint8_t* blk = row + b * bytes_of<QT>();
  s[0] = s[1] = h2f(blk);
  if (QT == IQ4_NL) {
    for (int l = 0; l < 32; ++l) v[l] = IQ4_VALUES[(blk[2 + l % 16] >> (4 * (l / 16))) & 0xF];
    return;
  }
  const uint8_t* qh = blk + (QT == Q5_1 ? 4 : 2);
  const uint8_t* qs = qh + 4;
  for (int l = 0; l < 32; ++l)
    v[l] = (int16_t)((((qs[l % 16] >> (4 * (l / 16))) & 0xF) | (((qh[l / 8] >> (l % 8)) & 1) << 4)) -
                     (QT == Q5_0 ? 16 : 0));
  if (QT == Q5_1) m[0] = m[1] = -h2f(blk + 2);
}

#ifdef PRQ_AVX2
// ---- SIMD rows, GGUF layout -----------------------------------------------------------------------

// IQ4_NL / IQ4_XS: block b (32 weights, nibbles at qs) times the MB rows, scale d.
template <int ISA, int MB>
inline void iq4_block(const uint8_t* qs, float d, int64_t b, __m256i table, const QRow* a, __m256* acc) {
  const __m256i t = _mm256_shuffle_epi8(table, nibbles32(qs));
  block_fma_signed<ISA, MB>(t, d, b, a, acc);  // T[q]: |T[q]| <= 127
}

template <int ISA, int QT, int MB>
void row_simd(const uint8_t* w, int64_t K, const QRow* a, float* out) {
  __m256 acc[MB];
  float corr[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = _mm256_setzero_ps();
    corr[m] = 0.f;
  }
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
  if (QT == IQ4_XS) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* blk = w + sb * 136;
      prefetch(blk, 136);
      const float d = h2f(blk);
      uint16_t sh;
      std::memcpy(&sh, blk + 2, 2);
      for (int j = 0; j < 8; ++j) {
        const int ls = ((blk[4 + j / 2] >> (4 * (j & 1))) & 0xF) | (((sh >> (2 * j)) & 3) << 4);
        iq4_block<ISA, MB>(blk + 8 + 16 * j, d * (float)(ls - 32), sb * 8 + j, table, a, acc);
      }
    }
  } else {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = w + b * bytes_of<QT>();
      prefetch(blk, 64);
      const float d = h2f(blk);
      if (QT == IQ4_NL) {
        iq4_block<ISA, MB>(blk + 2, d, b, table, a, acc);
        continue;
      }
      const uint8_t* qh = blk + (QT == Q5_1 ? 4 : 2);
      const __m256i u = _mm256_or_si256(nibbles32(qh + 4), bits_to_0x10(qh));
      const float off = QT == Q5_1 ? h2f(blk + 2) : -16.f * d;
      block_fma<ISA, MB>(u, d, b, a, acc);
      for (int m = 0; m < MB; ++m) corr[m] += off * a[m].s[b];
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]) + corr[m];
}
#endif  // PRQ_AVX2

// ---- tables -----------------------------------------------------------------------------------------

template <int QT>
struct Rows {  // pick_kernel's family: the GGUF-layout kernels of QT
  template <int ISA, int MB>
  static constexpr RowFn simd() {
#ifdef PRQ_AVX2
    return row_simd<ISA, QT, MB>;
#else
    return nullptr;
#endif
  }
  template <int MB>
  static constexpr RowFn scalar() { return row_scalar_decoded<decode<QT>, MB>; }
};

}  // namespace

const TypeKernels* small_kernels(int qt) {
  static const TypeKernels q50 = {32, 22, false, pick_kernel<Rows<Q5_0>>, decode<Q5_0>, small_r8(Q5_0)};
  static const TypeKernels q51 = {32, 24, false, pick_kernel<Rows<Q5_1>>, decode<Q5_1>, small_r8(Q5_1)};
  static const TypeKernels nl = {32, 18, false, pick_kernel<Rows<IQ4_NL>>, decode<IQ4_NL>, small_r8(IQ4_NL)};
  static const TypeKernels xs = {256, 136, false, pick_kernel<Rows<IQ4_XS>>, decode<IQ4_XS>, small_r8(IQ4_XS)};
  switch (qt) {
    case Q5_0: return &q50;
    case Q5_1: return &q51;
    case IQ4_NL: return &nl;
    case IQ4_XS: return &xs;
  }
  return nullptr;
}

}  // namespace prq
