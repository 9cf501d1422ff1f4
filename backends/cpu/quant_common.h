// What the quantized-linear sources share (quant_gemm.cpp: the driver, the activation rows,
// Q8_0/Q4_0/Q4_1/Q4_K; quant_kquants.cpp: Q6_K/Q5_K/Q3_K/Q2_K; quant_small.cpp: Q5_0/Q5_1/
// IQ4_NL/IQ4_XS): the instruction-set paths, float16/bfloat16 helpers, the quantized activation
// row (`QRow`), the 256-bit integer dot primitive, and `TypeKernels`, the table through which
// the driver runs the types the other files implement.
//
// Every SIMD kernel is one template over ISA whose paths differ only in `dot_u8s8` (and `dpbusd8`
// in the r8 kernels): AVX2 `vpmaddubsw` + `vpmaddwd`, AVX-VNNI / AVX-512 VNNI `vpdpbusd`. Where
// only AVX2 runs (the machines these kernels were written on: Zen 3, avx2 fma f16c), the VNNI
// paths are compiled (`-march=sapphirerapids`, or `-mavx512vnni -mavx512vl -mavxvnni`) but not
// run; the AVX2 tests cover their logic, the primitive aside.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PRQ_AVX2 1
#endif
#if defined(PRQ_AVX2) && defined(PRQ_EMULATE_VNNI)
// The "vnni_emulated" build (kernels.py): both VNNI paths compiled over AVX2 with `vpdpbusd` computed
// exactly by `dpbusd_emulated`, so that a CPU without VNNI runs (and tests) every VNNI kernel's logic.
#define PRQ_AVX512VNNI 1
#define PRQ_AVXVNNI 1
#else
#if defined(PRQ_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(PR_PORTABLE)
#define PRQ_AVX512VNNI 1
#endif
#if defined(PRQ_AVX2) && defined(__AVXVNNI__) && !defined(PR_PORTABLE)
#define PRQ_AVXVNNI 1
#endif
#endif

namespace prq {

enum QType {  // GGML type ids
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23,
};
enum Isa { SCALAR = 0, AVX2 = 1, AVXVNNI = 2, AVX512VNNI = 3 };
constexpr int MB_MAX = 4;  // activation rows per weight-row pass (accumulators in registers)
// IQ4_NL / IQ4_XS: the weight of 4-bit index q is T[q] times the block scale (llama.cpp's `kvalues_iq4nl`)
constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float h2f(const uint8_t* p) {  // little-endian IEEE float16 -> float
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef PRQ_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal float16: exact in float
    float f = std::ldexp((float)man, -24);
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2bf(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

inline void store(void* y, int bf16, int64_t i, float v) {
  if (bf16)
    static_cast<uint16_t*>(y)[i] = f2bf(v);
  else
    static_cast<float*>(y)[i] = v;
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One activation row quantized: q[K] int8 (|q| <= 127), per block of 32 its scale d, d * sum(q) and
// sum(q); per 16 inputs sum(q) for the types with 16-weight sub-blocks (else null).
struct QRow {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* qsum;   // per block of 32: sum(q)
  const int16_t* qsum16;  // per 16: sum(q), when the weight type's `TypeKernels::sum16`
};

// out[m] = dot(W row, x row m) for MB (1..MB_MAX) activation rows; w: one row of GGUF blocks.
using RowFn = void (*)(const uint8_t* w, int64_t K, const QRow* a, float* out);
// out[m][0..7] = the 8 rows of an r8 group times activation rows a[0..MB); nb = K / 32.
using GroupFn = void (*)(const uint8_t* gp, int64_t nb, const QRow* a, float (*out)[8]);
// Block b (of 32 weights) of a GGUF row as integers: w_i = s[h] * v[i] - m[h], h = i / 16 (the
// float32 operations of gguf's numpy dequantisation, so that the values equal it bit for bit).
using DecodeFn = void (*)(const uint8_t* row, int64_t b, int16_t* v, float* s, float* m);

// An r8 layout (see quant_gemm.cpp's header): groups of 8 output rows, each K / unit units of
// unit_bytes; `group` the kernel for path isa and mb rows (null where none), `repack` 8 GGUF rows
// (row_bytes apart, K weights each) -> one group, `dequant` a group -> its 8 rows of K floats
// (the values of `decode`, bit for bit). unit 0: no r8 layout.
struct R8Kernels {
  int unit, unit_bytes;
  GroupFn (*group)(int isa, int mb);
  void (*repack)(const uint8_t* rows, int64_t row_bytes, int64_t K, uint8_t* group);
  void (*dequant)(const uint8_t* group, int64_t K, float* rows);
};

// The kernels of one GGML type implemented outside quant_gemm.cpp.
struct TypeKernels {
  int block_size, block_bytes;
  bool sum16;                     // the kernels read QRow::qsum16
  RowFn (*row)(int isa, int mb);  // the GGUF-layout kernel for path isa, mb rows; null if not built
  DecodeFn decode;
  R8Kernels r8;
};
const TypeKernels* kquant_kernels(int qt);  // quant_kquants.cpp (Q6_K, Q5_K, Q3_K, Q2_K), else null
const TypeKernels* small_kernels(int qt);   // quant_small.cpp (Q5_0, Q5_1, IQ4_NL, IQ4_XS), else null
R8Kernels kquant_r8(int qt);                // quant_kquants_r8.cpp (Q6_K, Q5_K)
R8Kernels small_r8(int qt);                 // quant_small_r8.cpp (Q5_0, Q5_1, IQ4_NL, IQ4_XS)

// Scalar kernel for any type with a `DecodeFn`: per block and half, the integer dot of v with the
// activations' int8, times s, minus m times the half's sum of the int8 (all paths sum the same).
template <DecodeFn DECODE, int MB>
void row_scalar_decoded(const uint8_t* w, int64_t K, const QRow* a, float* out) {
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  int16_t v[32];
  float s[2], mn[2];
  for (int64_t b = 0; b < K / 32; ++b) {
    DECODE(w, b, v, s, mn);
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = a[m].q + b * 32;
      for (int h = 0; h < 2; ++h) {
        int dot = 0, sum = 0;
        for (int i = 16 * h; i < 16 * h + 16; ++i) {
          dot += v[i] * xq[i];
          sum += xq[i];
        }
        out[m] += a[m].d[b] * (s[h] * (float)dot - mn[h] * (float)sum);
      }
    }
  }
}

// A kernel table: the kernel of family F for path isa and mb activation rows (1..MB_MAX), i.e.
// F::template simd<ISA, MB>() on the SIMD paths this build has and F::template scalar<MB>() on the
// scalar one (either may be null: a family without that path); null for any other isa or mb.
template <class F, int MB>
auto pick_isa(int isa) -> decltype(F::template scalar<MB>()) {
  switch (isa) {
#ifdef PRQ_AVX512VNNI
    case AVX512VNNI: return F::template simd<AVX512VNNI, MB>();
#endif
#ifdef PRQ_AVXVNNI
    case AVXVNNI: return F::template simd<AVXVNNI, MB>();
#endif
#ifdef PRQ_AVX2
    case AVX2: return F::template simd<AVX2, MB>();
#endif
    case SCALAR: return F::template scalar<MB>();
  }
  return nullptr;
}

template <class F>
auto pick_kernel(int isa, int mb) -> decltype(F::template scalar<1>()) {
  static_assert(MB_MAX == 4, "one case per row count");
  switch (mb) {
    case 1: return pick_isa<F, 1>(isa);
    case 2: return pick_isa<F, 2>(isa);
    case 3: return pick_isa<F, 3>(isa);
    case 4: return pick_isa<F, 4>(isa);
  }
  return nullptr;
}

// ---- r8 blocks of 4- and 5-bit values (quant_kquants_r8.cpp, quant_small_r8.cpp) -------------------
// Per block of 32 inputs and group of 8 rows: 4 nibble vectors (byte 32k + 4r + i: row r's q of input
// 4k + i in the low nibble, of 16 + 4k + i in the high one; quant_gemm.cpp's Q4 r8 layout), then for
// 5-bit values one vector of fifth bits (byte 4r + i: bit k for input 4k + i, bit 4 + k for 16 + 4k + i).

inline void put_r8_q(uint8_t* p, int r, const uint8_t* q, bool fifth) {  // row r's q[32] into a block
  for (int k = 0; k < 4; ++k)
    for (int i = 0; i < 4; ++i) {
      const int a = q[4 * k + i], b = q[16 + 4 * k + i];
      p[32 * k + 4 * r + i] = (uint8_t)((a & 0xF) | ((b & 0xF) << 4));
      if (fifth) {
        uint8_t& h = p[128 + 4 * r + i];
        h = (uint8_t)((k == 0 ? 0 : h) | ((a >> 4) << k) | ((b >> 4) << (4 + k)));
      }
    }
}

#ifdef PRQ_AVX2
#ifdef PRQ_EMULATE_VNNI
// acc + per 32-bit lane the sum of the 4 products u8 * s8 (`vpdpbusd`'s result, exact: the bytes are
// widened to int16 before `vpmaddwd`, so nothing saturates).
inline __m256i dpbusd_emulated(__m256i acc, __m256i u, __m256i s) {
  const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF)), u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}
#undef _mm256_dpbusd_epi32  // a macro in some compilers' headers
#undef _mm256_dpbusd_avx_epi32
#define _mm256_dpbusd_epi32 dpbusd_emulated
#define _mm256_dpbusd_avx_epi32 dpbusd_emulated
#endif

template <int ISA>
inline __m256i dot_u8s8(__m256i u, __m256i s);  // lane i: sum of u[4i..4i+3] * s[4i..4i+3]
// AVX2: int16 pairs then lanes; exact while every u[2i] s[2i] + u[2i+1] s[2i+1] fits int16, which
// each caller states (|s| <= 127 from the activation quantizer: u <= 128 is always safe).
template <>
inline __m256i dot_u8s8<AVX2>(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#ifdef PRQ_AVXVNNI
template <>
inline __m256i dot_u8s8<AVXVNNI>(__m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#endif
#ifdef PRQ_AVX512VNNI
template <>
inline __m256i dot_u8s8<AVX512VNNI>(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#endif

#if defined(PRQ_AVXVNNI) || defined(PRQ_AVX512VNNI)
// s + the 4-byte dot products of unsigned u with signed x, on the VNNI path ISA.
template <int ISA>
inline __m256i dpbusd8(__m256i s, __m256i u, __m256i x) {
#if defined(PRQ_AVX512VNNI)
  if (ISA == AVX512VNNI) return _mm256_dpbusd_epi32(s, u, x);
#endif
#if defined(PRQ_AVXVNNI)
  return _mm256_dpbusd_avx_epi32(s, u, x);
#else
  return _mm256_dpbusd_epi32(s, u, x);
#endif
}
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i nibbles32(const uint8_t* qs) {  // 16 bytes -> 32 values: low nibbles, then high nibbles
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc[m] += f * a[m].d[b] * (the 32 unsigned u with activation block b of row m), for m < MB.
template <int ISA, int MB>
inline void block_fma(__m256i u, float f, int64_t b, const QRow* a, __m256* acc) {
  for (int m = 0; m < MB; ++m) {
    const __m256i p = dot_u8s8<ISA>(u, load32(a[m].q + b * 32));
    acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(f * a[m].d[b]), _mm256_cvtepi32_ps(p), acc[m]);
  }
}

// The same for 32 signed w (|w| <= 127): |w| with the activations given w's signs.
template <int ISA, int MB>
inline void block_fma_signed(__m256i w, float f, int64_t b, const QRow* a, __m256* acc) {
  const __m256i u = _mm256_sign_epi8(w, w);
  for (int m = 0; m < MB; ++m) {
    const __m256i p = dot_u8s8<ISA>(u, _mm256_sign_epi8(load32(a[m].q + b * 32), w));
    acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(f * a[m].d[b]), _mm256_cvtepi32_ps(p), acc[m]);
  }
}

// 32 bits (little-endian at p) -> 32 bytes, byte i = 0x10 when bit i is set, else 0 (the fifth
// bit of Q5_0 / Q5_1 weights).
inline __m256i bits_to_0x10(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),  // byte i <- byte i / 8
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                0x0303030303030303));
  const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // byte i: every bit but i % 8
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// lo[k], hi[k] (k = 0..3): the values of a 4- or 5-bit r8 block, inputs 4k + i and 16 + 4k + i.
inline void load_r8_q(const uint8_t* p, bool fifth, __m256i* lo, __m256i* hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
  const __m256i h = fifth ? load32(p + 128) : _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) {
    const __m256i v = load32(p + 32 * k);
    lo[k] = _mm256_and_si256(v, m4);
    hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (fifth) {  // bit k, bit 4 + k of h to bit 4 (epi16 shifts: the mask drops what crossed bytes)
      lo[k] = _mm256_or_si256(lo[k], _mm256_and_si256(_mm256_slli_epi16(h, 4 - k), m10));
      hi[k] = _mm256_or_si256(hi[k], _mm256_and_si256(_mm256_srli_epi16(h, k), m10));
    }
  }
}

// An r8 block's values as floats: v[0..3] the signed int8 values of inputs 4k + i, v[4..7] of
// 16 + 4k + i (lane r: row r, as `load_r8_q` gives them) -> out[r K + l] = s_h[r] v - m_h[r] for the 8
// rows r, h = l / 16 (an 8 x 8 transpose of 4-byte lanes, then per row 32 conversions).
inline void r8_rows(const __m256i* v, const float* s0, const float* s1, const float* m0, const float* m1,
                    float* out, int64_t K) {
  __m256i t[8], u[8];
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_epi32(v[j], v[j + 1]);
    t[j + 1] = _mm256_unpackhi_epi32(v[j], v[j + 1]);
  }
  for (int j = 0; j < 8; j += 4) {
    u[j] = _mm256_unpacklo_epi64(t[j], t[j + 2]);
    u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);
    u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]);
    u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  for (int r = 0; r < 8; ++r) {  // row r: the 128-bit halves r / 4 of u[r % 4] and u[4 + r % 4]
    const __m256i row = r < 4 ? _mm256_permute2x128_si256(u[r % 4], u[4 + r % 4], 0x20)
                              : _mm256_permute2x128_si256(u[r % 4], u[4 + r % 4], 0x31);
    const __m128i h[2] = {_mm256_castsi256_si128(row), _mm256_extracti128_si256(row, 1)};
    for (int c = 0; c < 4; ++c) {
      const __m128i bytes = c & 1 ? _mm_srli_si128(h[c / 2], 8) : h[c / 2];
      const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const float s = c < 2 ? s0[r] : s1[r], m = c < 2 ? m0[r] : m1[r];
      _mm256_storeu_ps(out + r * K + 8 * c, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(s), x), _mm256_set1_ps(m)));
    }
  }
}

#if defined(PRQ_AVXVNNI) || defined(PRQ_AVX512VNNI)
#define PRQ_DPBUSD8(ISA, s, u, x) dpbusd8<ISA>(s, u, x)
#else
#define PRQ_DPBUSD8(ISA, s, u, x) (s)  // unreachable: only the AVX2 path is compiled
#endif

// 8 int32 lanes (rows) = sum over 16 inputs of v[k] (k = 0..3: inputs 4k..4k+3 of x) times x.
// AVX2: int16 sums of PAIR maddubs results (each at most 2 * QMAX * 127) before widening, so
// PAIR * 2 * QMAX * 127 <= 32767 is the caller's bound. VNNI: two chains of two `vpdpbusd`.
template <int ISA, int PAIR>
inline __m256i dot16(const __m256i* v, const int8_t* x) {
  if (ISA == AVX2) {
    __m256i s = _mm256_setzero_si256();
    for (int k0 = 0; k0 < 4; k0 += PAIR) {
      __m256i t = _mm256_maddubs_epi16(v[k0], bcast4(x + 4 * k0));
      for (int k = k0 + 1; k < k0 + PAIR; ++k) t = _mm256_add_epi16(t, _mm256_maddubs_epi16(v[k], bcast4(x + 4 * k)));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(t, _mm256_set1_epi16(1)));
    }
    return s;
  }
  __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int k = 0; k < 4; ++k) s[k & 1] = PRQ_DPBUSD8(ISA, s[k & 1], v[k], bcast4(x + 4 * k));
  return _mm256_add_epi32(s[0], s[1]);
}

// 8 int32 lanes (rows) = the 32-input block dots of 4-bit values (lo/hi as `load_r8_q` gives them)
// with x. AVX2: all 8 `maddubs` summed in int16 (8 products of <= 15 * 127 * 2 each: at most 30480),
// widened once. VNNI: four independent chains of two `vpdpbusd` each, added at the end. One chain of
// eight made each block wait ~8 instruction latencies, more than the out-of-order window could
// cover with other blocks: the kernel ran at ~40 cycles a block from L2, compute-bound.
template <int ISA>
inline __m256i block_dot4bit(const __m256i* lo, const __m256i* hi, const int8_t* xq) {
  if (ISA == AVX2) {
    __m256i s16 = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[k], bcast4(xq + 4 * k)));
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[k], bcast4(xq + 16 + 4 * k)));
    }
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
  }
  __m256i s[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int k = 0; k < 4; ++k) {
    s[k & 1] = PRQ_DPBUSD8(ISA, s[k & 1], lo[k], bcast4(xq + 4 * k));
    s[2 + (k & 1)] = PRQ_DPBUSD8(ISA, s[2 + (k & 1)], hi[k], bcast4(xq + 16 + 4 * k));
  }
  return _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
}

inline __m256 scales8(const uint8_t* p, __m256 d, bool is_signed) {  // 8 int8 / uint8 at p, times d
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b)));
}

inline __m256 load_f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Weight bytes fetched ahead of the block being computed: the rows stream through
// memory once per step, and a hardware prefetcher stops at each 4 KiB page.
constexpr int64_t PF_BYTES = 3072;

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t e = 0; e < bytes; e += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PF_BYTES + e), _MM_HINT_T0);
}
#endif  // PRQ_AVX2

}  // namespace prq
