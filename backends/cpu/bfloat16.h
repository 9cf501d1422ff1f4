// bfloat16 in the CPU kernels: the scalar conversions (`ld`: bfloat16 bits or a float -> float;
// `st`: float -> bfloat16 rounded to nearest even, or a float stored as it is; `rnd`: a float rounded
// to bfloat16 and back) and, where PR_BF16_DOT is defined, their 16-lane AVX-512 forms.
//
// PR_BF16_DOT: the AVX-512 (F + BF16) paths. Without it (another CPU, or built with
// -DPR_PORTABLE, as the tests do to run the fallback on every CPU) every op runs
// its plain loops, which the compiler vectorises for the CPU it targets.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(PR_PORTABLE)
#include <immintrin.h>
#define PR_BF16_DOT 1
#endif

namespace {
inline float ld(float x) { return x; }
inline float ld(uint16_t x) {  // bfloat16 bits -> float
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void st(float* p, float f) { *p = f; }
inline void st(uint16_t* p, float f) {  // float -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { *p = uint16_t((u >> 16) | 0x40); return; }  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = uint16_t(u >> 16);
}
inline float rnd(float f) {  // round to bfloat16 and back
  uint16_t b;
  st(&b, f);
  return ld(b);
}

#ifdef PR_BF16_DOT
// 16 bfloat16 <-> 16 floats; rnd16 rounds to bfloat16 (nearest even) and back.
inline __m512 ld16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m256i bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline void st16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16(v)); }
inline __m512 rnd16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(v)), 16));
}
#endif
}  // namespace
