// The K-quant types besides Q4_K (quant_gemm.cpp): Q6_K, Q5_K, Q3_K, Q2_K, for the quantized
// linear of quant_gemm.cpp (through `TypeKernels`; the activations, the driver and the threads are
// its). Super-blocks of 256 weights, as llama.cpp's ggml-common.h lays them out (bytes):
//   Q6_K (210)  ql[128] low 4 bits, qh[64] high 2 bits, scales[16] int8, d f16
//               w = d sc_s (q - 32), q 0..63, s = i / 16
//   Q5_K (176)  d f16, dmin f16, scales[12] (Q4_K's 6-bit sc_j, mn_j), qh[32] bit j, qs[128] nibbles
//               w = d sc_j q - dmin mn_j, q 0..31, j = i / 32
//   Q3_K (110)  hmask[32] (bit j: q += 4), qs[64] low 2 bits, scales[12] (16 x 6 bits), d f16
//               w = d (sc_s - 32) (q - 4), q 0..7
//   Q2_K (84)   scales[16] (low nibble sc_s, high nibble mn_s), qs[64] 2 bits, d f16, dmin f16
//               w = d sc_s q - dmin mn_s, q 0..3
// Within a super-block, block B (0..7) of 32 weights takes for weight l (0..31): Q6_K the nibble
// (B & 2 ? high : low) of ql[64 (B / 4) + 32 (B & 1) + l] and bits 2 (B & 3) of qh[32 (B / 4) + l];
// Q5_K the nibble B & 1 of qs[32 (B / 2) + l] and bit B of qh[l]; Q3_K / Q2_K bits 2 (B & 3) of
// qs[32 (B / 4) + l] (Q3_K: and bit B of hmask[l]).
//
// The SIMD kernels (GGUF layout) build each block's 32 unsigned q as bytes and take the 8-lane
// integer dot with the activations' int8 (`dot_u8s8`: lanes 0-3 sum weights 0-15, lanes 4-7 weights
// 16-31, so a 16-weight sub-block's scale is a lane half); the constant offsets (Q6_K's 32, Q3_K's 4)
// and Q2_K's mins multiply the activations' per-16 sums (`QRow::qsum16`) with the scales, in
// integers per block of 32, once per super-block. AVX2's `maddubs` pairs stay below int16's
// limit: 63 * 127 * 2 = 16002 at most (Q6_K).

#include "quant_common.h"

namespace prq {
namespace {

// ---- GGUF blocks as integers (`DecodeFn`: w = s[h] v - m[h], gguf's float32 operations) ----------

void decode_q6k(const uint8_t* row, int64_t b, int16_t* v, float* s, float* m) {
  const uint8_t* blk = row + (b / 8) * 210;
  const int B = (int)(b % 8);
  const uint8_t* ql = blk + 64 * (B / 4) + 32 * (B & 1);
  const uint8_t* qh = blk + 128 + 32 * (B / 4);
  const int ns = B & 2 ? 4 : 0, hs = 2 * (B & 3);
  for (int l = 0; l < 32; ++l) v[l] = (int16_t)((((ql[l] >> ns) & 0xF) | (((qh[l] >> hs) & 3) << 4)) - 32);
  const float d = h2f(blk + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  s[0] = d * (float)sc[2 * B];
  s[1] = d * (float)sc[2 * B + 1];
  m[0] = m[1] = 0.f;
}

void decode_q5k(const uint8_t* row, int64_t b, int16_t* v, float* s, float* m) {
  const uint8_t* blk = row + (b / 8) * 176;
  const int j = (int)(b % 8);
  const uint8_t* qs = blk + 48 + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) v[l] = (int16_t)(((qs[l] >> (4 * (j & 1))) & 0xF) | (((blk[16 + l] >> j) & 1) << 4));
  int sc, mn;
  scale_min_k4(j, blk + 4, &sc, &mn);
  s[0] = s[1] = h2f(blk) * (float)sc;
  m[0] = m[1] = h2f(blk + 2) * (float)mn;
}

// Q3_K: the 16 scales (6 bits each, minus 32) from their 12 packed bytes.
inline void scales_q3k(const uint8_t* p, int* sc) {
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? p[i] & 0xF : p[i - 8] >> 4, high = (p[8 + i % 4] >> (2 * (i / 4))) & 3;
    sc[i] = (low | (high << 4)) - 32;
  }
}

void decode_q3k(const uint8_t* row, int64_t b, int16_t* v, float* s, float* m) {
  const uint8_t* blk = row + (b / 8) * 110;
  const int B = (int)(b % 8);
  const uint8_t* qs = blk + 32 + 32 * (B / 4);
  for (int l = 0; l < 32; ++l) v[l] = (int16_t)(((qs[l] >> (2 * (B & 3))) & 3) + 4 * ((blk[l] >> B) & 1) - 4);
  int sc[16];
  scales_q3k(blk + 96, sc);
  const float d = h2f(blk + 108);
  s[0] = d * (float)sc[2 * B];
  s[1] = d * (float)sc[2 * B + 1];
  m[0] = m[1] = 0.f;
}

void decode_q2k(const uint8_t* row, int64_t b, int16_t* v, float* s, float* m) {
  const uint8_t* blk = row + (b / 8) * 84;
  const int B = (int)(b % 8);
  const uint8_t* qs = blk + 16 + 32 * (B / 4);
  for (int l = 0; l < 32; ++l) v[l] = (int16_t)((qs[l] >> (2 * (B & 3))) & 3);
  const float d = h2f(blk + 80), dmin = h2f(blk + 82);
  for (int h = 0; h < 2; ++h) {
    s[h] = d * (float)(blk[2 * B + h] & 0xF);
    m[h] = dmin * (float)(blk[2 * B + h] >> 4);
  }
}

#ifdef PRQ_AVX2
// ---- SIMD rows, GGUF layout -----------------------------------------------------------------------

// Lanes 0-3 = f[2r], lanes 4-7 = f[2r + 1]: the scales of block r's two 16-weight halves.
inline __m256 halves(__m256 f, int r) {
  return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(2 * r, 2 * r, 2 * r, 2 * r, 2 * r + 1, 2 * r + 1,
                                                       2 * r + 1, 2 * r + 1));
}

// A super-block of a type with 16-weight sub-blocks (Q6_K, Q3_K, Q2_K), ready for the dot products:
// f[0], f[1] the float scales of sub-blocks 0-7 and 8-15; w = f_s q + coef * o_s (o16: the int16
// o_s, per sub-block: Q6_K sc_s with coef -32 d, Q3_K sc_s - 32 with -4 d, Q2_K mn_s with -dmin).
struct Sub16 {
  __m256 f[2];
  __m256i o16;
  float coef;
};

template <int QT>
inline Sub16 sub16(const uint8_t* blk) {
  Sub16 r;
  if (QT == Q6_K) {
    const float d = h2f(blk + 208);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    r.f[0] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    r.f[1] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    r.o16 = _mm256_cvtepi8_epi16(sc);
    r.coef = -32.f * d;
  } else if (QT == Q3_K) {  // `scales_q3k`, 16 at once: low nibbles of bytes 0-7, then their high ones,
    const float d = h2f(blk + 108);  // each | bits 2 (i / 4) of byte 8 + i % 4 << 4
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 96)), m4 = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
    uint32_t hb;
    std::memcpy(&hb, blk + 104, 4);
    const __m128i high = _mm_srlv_epi32(_mm_set1_epi32((int)hb), _mm_setr_epi32(0, 2, 4, 6));
    const __m128i sc = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(_mm_and_si128(high, _mm_set1_epi8(3)), 4)),
                                    _mm_set1_epi8(32));
    r.f[0] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    r.f[1] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    r.o16 = _mm256_cvtepi8_epi16(sc);
    r.coef = -4.f * d;
  } else {  // Q2_K
    const float d = h2f(blk + 80), dmin = h2f(blk + 82);
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
    const __m128i lo = _mm_and_si128(sc, _mm_set1_epi8(0x0F));
    r.f[0] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
    r.f[1] = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
    r.o16 = _mm256_srli_epi16(_mm256_cvtepu8_epi16(sc), 4);
    r.coef = -dmin;
  }
  return r;
}

// The 4 blocks (32 q each, as bytes) of half h (0, 1) of a super-block.
template <int QT>
inline void units16(const uint8_t* blk, int h, __m256i* u) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  if (QT == Q6_K) {
    const __m256i ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32), qh = load32(blk + 128 + 32 * h);
    const __m256i m30 = _mm256_set1_epi8(0x30);  // the high bits' place (epi16 shifts: the mask drops what crossed)
    u[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
    u[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
    u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
    u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
  } else {
    const __m256i qs = load32(blk + (QT == Q3_K ? 32 : 16) + 32 * h);
    u[0] = _mm256_and_si256(qs, m3);
    u[1] = _mm256_and_si256(_mm256_srli_epi16(qs, 2), m3);
    u[2] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), m3);
    u[3] = _mm256_and_si256(_mm256_srli_epi16(qs, 6), m3);
    if (QT == Q3_K) {  // + 4 where bit 4h + r of hmask[l] is set
      const __m256i hm = _mm256_srli_epi16(load32(blk), 4 * h), m4b = _mm256_set1_epi8(4);
      u[0] = _mm256_or_si256(u[0], _mm256_and_si256(_mm256_slli_epi16(hm, 2), m4b));
      u[1] = _mm256_or_si256(u[1], _mm256_and_si256(_mm256_slli_epi16(hm, 1), m4b));
      u[2] = _mm256_or_si256(u[2], _mm256_and_si256(hm, m4b));
      u[3] = _mm256_or_si256(u[3], _mm256_and_si256(_mm256_srli_epi16(hm, 1), m4b));
    }
  }
}

// Q6_K / Q3_K / Q2_K: per block of 32 one dot (8 lanes) scaled by its two halves' scales; the
// offsets per super-block from the per-16 sums (madd: 8 lanes = the 8 blocks).
template <int ISA, int QT, int MB>
void row_k16(const uint8_t* w, int64_t K, const QRow* a, float* out) {
  constexpr int BB = QT == Q6_K ? 210 : QT == Q3_K ? 110 : 84;
  __m256 acc[MB], off[MB];
  for (int m = 0; m < MB; ++m) acc[m] = off[m] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* blk = w + sb * BB;
    prefetch(blk, BB);
    const Sub16 s = sub16<QT>(blk);
    for (int m = 0; m < MB; ++m) {
      const __m256i t = _mm256_madd_epi16(s.o16, load32(a[m].qsum16 + sb * 16));
      const __m256 dx = _mm256_loadu_ps(a[m].d + sb * 8);
      off[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dx, _mm256_set1_ps(s.coef)), off[m]);
    }
    for (int h = 0; h < 2; ++h) {
      __m256i u[4];
      units16<QT>(blk, h, u);
      for (int r = 0; r < 4; ++r) {
        const int64_t b = sb * 8 + 4 * h + r;
        const __m256 f = halves(s.f[h], r);
        for (int m = 0; m < MB; ++m) {
          const __m256i p = dot_u8s8<ISA>(u[r], load32(a[m].q + b * 32));
          acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(f, _mm256_set1_ps(a[m].d[b])), _mm256_cvtepi32_ps(p), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(_mm256_add_ps(acc[m], off[m]));
}

// Q5_K: Q4_K's scheme (one scale and min per 32) with the fifth bit from qh.
template <int ISA, int MB>
void row_q5k(const uint8_t* w, int64_t K, const QRow* a, float* out) {
  __m256 acc[MB];
  float corr[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = _mm256_setzero_ps();
    corr[m] = 0.f;
  }
  const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const uint8_t* blk = w + sb * 176;
    prefetch(blk, 176);
    const float d = h2f(blk), dmin = h2f(blk + 2);
    int sc[8], mn[8];
    for (int j = 0; j < 8; ++j) scale_min_k4(j, blk + 4, &sc[j], &mn[j]);
    // bit j of qh[l] to bit 4: (qh << 4) >> j for j < 4, qh >> (j - 4) after (epi16 shifts: the
    // 0x10 mask drops what crossed between bytes; << 4 loses the high byte's bits 4-7, used from j = 4)
    __m256i hb = _mm256_slli_epi16(load32(blk + 16), 4);
    for (int p = 0; p < 4; ++p) {
      if (p == 2) hb = load32(blk + 16);
      const __m256i bytes = load32(blk + 48 + 32 * p);
      __m256i u[2] = {_mm256_and_si256(bytes, m4), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4)};
      for (int i = 0; i < 2; ++i) {
        u[i] = _mm256_or_si256(u[i], _mm256_and_si256(hb, m10));
        hb = _mm256_srli_epi16(hb, 1);
      }
      for (int i = 0; i < 2; ++i) {
        const int j = 2 * p + i;
        const int64_t b = sb * 8 + j;
        const float f = d * (float)sc[j];
        block_fma<ISA, MB>(u[i], f, b, a, acc);  // u <= 31: 31 * 127 * 2 per int16 pair
      }
    }
    for (int m = 0; m < MB; ++m) {
      float c = 0.f;
      for (int j = 0; j < 8; ++j) c += (float)mn[j] * a[m].s[sb * 8 + j];
      corr[m] -= dmin * c;
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
    if constexpr (QT == Q5_K)
      return row_q5k<ISA, MB>;
    else
      return row_k16<ISA, QT, MB>;
#else
    return nullptr;
#endif
  }
  template <int MB>
  static constexpr RowFn scalar() {
    constexpr DecodeFn D = QT == Q6_K ? decode_q6k : QT == Q5_K ? decode_q5k : QT == Q3_K ? decode_q3k : decode_q2k;
    return row_scalar_decoded<D, MB>;
  }
};

}  // namespace

const TypeKernels* kquant_kernels(int qt) {
  static const TypeKernels q6 = {256, 210, true, pick_kernel<Rows<Q6_K>>, decode_q6k, kquant_r8(Q6_K)};
  static const TypeKernels q5 = {256, 176, false, pick_kernel<Rows<Q5_K>>, decode_q5k, kquant_r8(Q5_K)};
  static const TypeKernels q3 = {256, 110, true, pick_kernel<Rows<Q3_K>>, decode_q3k, {}};
  static const TypeKernels q2 = {256, 84, true, pick_kernel<Rows<Q2_K>>, decode_q2k, {}};
  switch (qt) {
    case Q6_K: return &q6;
    case Q5_K: return &q5;
    case Q3_K: return &q3;
    case Q2_K: return &q2;
  }
  return nullptr;
}

}  // namespace prq
