// exp16: exp of 16 floats at once (AVX-512), for softmax after max subtraction (x <= 0):
// 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], degree-6 Taylor for 2^f (relative
// error ~1e-8), the same polynomial as paged_attention.cpp's scalar fast_exp.
// Shared by the attention kernels (paged_attention.cpp, prefill_attention.cpp).
// exp2_16: 2^t of 16 floats (t <= 0, -inf gives 0) for probabilities rounded to bfloat16 next:
// degree-5 Taylor for 2^f (relative error ~2.4e-6) and `vscalefps` for 2^n, 9 instructions.
#pragma once

#if defined(__AVX512F__) && !defined(PR_PORTABLE)
#include <immintrin.h>

namespace {
// 2^f for f in [-0.5, 0.5]: the Taylor polynomial of degree DEG (Horner, highest coefficient first).
template <int DEG>
inline __m512 pow2_taylor(__m512 f) {
  constexpr float c[7] = {1.f, 6.9314718055994531e-1f, 2.4022650695910071e-1f, 5.5504108664821580e-2f,
                          9.6181291076284772e-3f, 1.3333558146428443e-3f, 1.5403530393381608e-4f};
  __m512 p = _mm512_set1_ps(c[DEG]);
  for (int k = DEG - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[k]));
  return p;
}

inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 p = pow2_taylor<6>(_mm512_sub_ps(t, n));
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

inline __m512 exp2_16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(pow2_taylor<5>(_mm512_sub_ps(t, n)), n);
}
}  // namespace
#endif
