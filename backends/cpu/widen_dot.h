// Float32 dot products over weight rows stored as float32 or bfloat16 (widened on the fly):
// the small-block GEMM core the grouped kernels (moe_experts.cpp, lora_kernel.cpp) share.
// AVX-512F where the build targets it (bf16 -> fp32 by zero-extend and shift), else a
// portable loop the compiler vectorises (PR_PORTABLE: the POLYRUNNER_CPU_SIMD=0 build).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && !defined(PR_PORTABLE)
#include <immintrin.h>
#define PR_WIDEN_AVX512 1
#endif

namespace pr_widen {
constexpr int MR = 6, NR = 4;      // token rows x weight rows per dot block

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {   // nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef PR_WIDEN_AVX512
// float32 -> bfloat16 (nearest even, NaN kept quiet) of 16 lanes, AVX-512F only.
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}
#endif

inline float load1(const float* w, int64_t k) { return w[k]; }
inline float load1(const uint16_t* w, int64_t k) { return bf16_to_f32(w[k]); }

#ifdef PR_WIDEN_AVX512
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const uint16_t* w) {   // bfloat16 -> float32: widen, shift left 16 (AVX-512F)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), 16));
}
#endif

// res[m][n] = sum_k x[m][k] * w[n][k] for m < M, n < N (x rows float32, w rows of W).
template <class W, int M, int N>
void dot_block(const float* const* x, const W* const* w, int64_t K, float res[MR][NR]) {
  int64_t k = 0;
#ifdef PR_WIDEN_AVX512
  __m512 acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) acc[m][n] = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m512 wv[N];
    for (int n = 0; n < N; ++n) wv[n] = load16(w[n] + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_loadu_ps(x[m] + k);
      for (int n = 0; n < N; ++n) acc[m][n] = _mm512_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) res[m][n] = _mm512_reduce_add_ps(acc[m][n]);
#else
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) res[m][n] = 0.0f;
#endif
  for (; k < K; ++k)   // the tail (everything in the portable build: a loop the compiler vectorises)
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) res[m][n] += x[m][k] * load1(w[n], k);
}

template <class W, int N>
void dot_rows(int mr, const float* const* x, const W* const* w, int64_t K, float res[MR][NR]) {
  switch (mr) {
    case 1: return dot_block<W, 1, N>(x, w, K, res);
    case 2: return dot_block<W, 2, N>(x, w, K, res);
    case 3: return dot_block<W, 3, N>(x, w, K, res);
    case 4: return dot_block<W, 4, N>(x, w, K, res);
    case 5: return dot_block<W, 5, N>(x, w, K, res);
    default: return dot_block<W, 6, N>(x, w, K, res);
  }
}

template <class W>
void dot(int mr, int nr, const float* const* x, const W* const* w, int64_t K, float res[MR][NR]) {
  switch (nr) {
    case 1: return dot_rows<W, 1>(mr, x, w, K, res);
    case 2: return dot_rows<W, 2>(mr, x, w, K, res);
    case 3: return dot_rows<W, 3>(mr, x, w, K, res);
    default: return dot_rows<W, 4>(mr, x, w, K, res);
  }
}
}  // namespace pr_widen
