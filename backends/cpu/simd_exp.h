// fast_exp: exp of one float, branch-free so that the loops calling it vectorise (the softmax
// of the attention kernels, silu in fused_elementwise.cpp): 2^(x log2 e) split into 2^n * 2^f,
// f in [-0.5, 0.5], degree-6 Taylor for 2^f (relative error ~1e-8); x clamped to [-87, 88].
// exp8: the same on 8 floats (AVX2 + FMA), for the float32 decode attention.
// exp16: exp of 16 floats at once (AVX-512), for softmax after max subtraction (x <= 0):
// 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], degree-6 Taylor for 2^f (relative
// error ~1e-8), fast_exp's polynomial.
// Shared by the attention kernels (paged_attention.cpp, prefill_attention.cpp).
// tanh16 / softcap16: the attention logit soft cap, cap * tanh(s / cap), on 16 scores.
// exp2_16: 2^t of 16 floats (t <= 0, -inf gives 0) for probabilities rounded to bfloat16 next:
// degree-5 Taylor for 2^f (relative error ~2.4e-6) and `vscalefps` for 2^n, 9 instructions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {
// 2^f for f in [-0.5, 0.5]: Taylor coefficients of degree 0..6, shared by every exp here.
constexpr float POW2_TAYLOR[7] = {1.f, 6.9314718055994531e-1f, 2.4022650695910071e-1f, 5.5504108664821580e-2f,
                                  9.6181291076284772e-3f, 1.3333558146428443e-3f, 1.5403530393381608e-4f};

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.4426950408889634f;
  const float n = __builtin_rintf(t);
  const float f = t - n;
  float p = POW2_TAYLOR[6];
  for (int k = 5; k >= 0; --k) p = p * f + POW2_TAYLOR[k];
  uint32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += uint32_t(int32_t(n)) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}
}  // namespace

#if defined(__AVX2__) && defined(__FMA__) && !defined(PR_PORTABLE)
#include <immintrin.h>

namespace {
// exp8: fast_exp of 8 floats at once (AVX2 + FMA; x <= 0 after a max subtraction, clamped at -87).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(POW2_TAYLOR[6]);
  for (int k = 5; k >= 0; --k) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(POW2_TAYLOR[k]));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
}  // namespace
#endif

#if defined(__AVX512F__) && !defined(PR_PORTABLE)
#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace {
// 2^f for f in [-0.5, 0.5]: the Taylor polynomial of degree DEG (Horner, highest coefficient first).
template <int DEG>
inline __m512 pow2_taylor(__m512 f) {
  __m512 p = _mm512_set1_ps(POW2_TAYLOR[DEG]);
  for (int k = DEG - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(POW2_TAYLOR[k]));
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

// tanh of 16 floats: odd Taylor polynomial (degree 9) below |x| = 0.3, else (1 - e) / (1 + e) with
// e = exp(-2|x|) in (0, 1] (no overflow; exp16 clamps, so +-inf gives +-1), the sign put back.
// Absolute error ~1e-7 everywhere (relative below 0.3), where 1 - 2 / (exp(2x) + 1) loses the
// small |x| to cancellation. For the attention logit soft cap (Gemma 2).
inline __m512 tanh16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 a = _mm512_abs_ps(x);
  const __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.f)));
  const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 a2 = _mm512_mul_ps(a, a);
  __m512 p = _mm512_set1_ps(62.f / 2835.f);
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-17.f / 315.f));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(2.f / 15.f));
  p = _mm512_fmadd_ps(p, a2, _mm512_set1_ps(-1.f / 3.f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, a2), a, a);
  const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.3f), _CMP_LT_OQ), big, small);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(int32_t(0x80000000u)));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

// Attention logit soft cap: cap * tanh(s / cap) (cap > 0); -inf lanes (masked scores) stay -inf.
inline __m512 softcap16(__m512 s, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  const __m512 t = _mm512_mul_ps(c, tanh16(_mm512_div_ps(s, c)));
  const __mmask16 finite = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                              _CMP_NEQ_OQ);
  return _mm512_mask_mov_ps(s, finite, t);
}

inline __m512 exp2_16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(pow2_taylor<5>(_mm512_sub_ps(t, n)), n);
}
}  // namespace
#endif
