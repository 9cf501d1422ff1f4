// The decoder layers' elementwise ops as one pass over each row (fused_modules.py): RMSNorm, the
// residual add + RMSNorm, silu(gate) * up and the rotary embedding (in place). Rows are split
// between threads by `pr::for_rows` (the pool, or OpenMP's team in larger steps).
//
// `dtype` as the other kernels take it (kernels.DTYPES): 1 bfloat16, computed in float32 and
// rounded exactly where Hugging Face's modules round (each op's result, products in the rotary), so
// the outputs are torch's bits up to the order of a sum; 0 float32, torch's float32 math (sums in
// another order). Each op returns 0, or -1 for an unknown dtype.

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "bfloat16.h"
#include "simd_exp.h"
#include "thread_pool.h"

namespace {

// What the element type E rounds a float32 result to: bfloat16 and back, or nothing (float).
template <class E>
inline float round_to(float f) {
  if constexpr (std::is_same_v<E, uint16_t>) return rnd(f);
  return f;
}

template <class E>
constexpr bool kBF16 = std::is_same_v<E, uint16_t>;

// f(E{}) for the element type of `dtype`; -1 for an unknown one.
template <class F>
int by_dtype(int dtype, F f) {
  if (dtype == 1) return f(uint16_t{}), 0;
  if (dtype == 0) return f(float{}), 0;
  return -1;
}

// o = w * E(x * rsqrt(mean(x^2) + eps)) for one row of H (Hugging Face's RMSNorm).
template <class E>
inline void rms_norm_row(const E* x, const E* w, E* o, int64_t H, float eps) {
#ifdef PR_BF16_DOT
  if constexpr (kBF16<E>) {
    if (H % 16 == 0) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < H; d += 16) {
        const __m512 v = ld16(x + d);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / float(H) + eps));
      for (int64_t d = 0; d < H; d += 16) st16(o + d, _mm512_mul_ps(ld16(w + d), rnd16(_mm512_mul_ps(ld16(x + d), r))));
      return;
    }
  }
#endif
  float ss = 0.f;
  for (int64_t d = 0; d < H; ++d) ss += ld(x[d]) * ld(x[d]);
  const float r = 1.f / std::sqrt(ss / float(H) + eps);
  for (int64_t d = 0; d < H; ++d) st(o + d, ld(w[d]) * round_to<E>(ld(x[d]) * r));
}

template <class E>
void rms_norm(const E* x, int64_t x_ts, const E* w, E* out, int64_t o_ts, int64_t T, int64_t H, float eps) {
  pr::for_rows(T, T * H >= 16384, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_norm_row(x + t * x_ts, w, out + t * o_ts, H, eps);
  });
}

template <class E>
void add_rms_norm(const E* x, const E* res, const E* w, E* r_out, E* out, int64_t T, int64_t H, float eps) {
  pr::for_rows(T, T * H >= 16384, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const E* xr = x + t * H;
      const E* rr = res + t * H;
      E* ro = r_out + t * H;
      int64_t d = 0;
#ifdef PR_BF16_DOT
      if constexpr (kBF16<E>) {
        for (; d + 16 <= H; d += 16) st16(ro + d, _mm512_add_ps(ld16(xr + d), ld16(rr + d)));
      }
#endif
      for (; d < H; ++d) st(ro + d, ld(xr[d]) + ld(rr[d]));
      rms_norm_row(ro, w, out + t * H, H, eps);  // the row is still in L1
    }
  });
}

template <class E>
void silu_mul(const E* gu, int64_t g_ts, E* out, int64_t o_ts, int64_t T, int64_t I) {
  pr::for_rows(T, T * I >= 16384, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const E* g = gu + t * g_ts;
      const E* u = g + I;
      E* o = out + t * o_ts;
      int64_t d0 = 0;
#ifdef PR_BF16_DOT
      if constexpr (kBF16<E>) {
        for (; d0 + 16 <= I; d0 += 16) {  // the scalar loop's math, 16 lanes at a time
          const __m512 a = ld16(g + d0);
          const __m512 e = exp16(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), _mm512_set1_ps(88.f)));
          const __m512 sl = rnd16(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
          st16(o + d0, _mm512_mul_ps(sl, ld16(u + d0)));
        }
      }
#endif
      for (int64_t d = d0; d < I; ++d) {
        const float a = ld(g[d]);
        st(o + d, round_to<E>(a / (1.f + fast_exp(-a))) * ld(u[d]));
      }
    }
  });
}

// x[t, h] (token stride x_ts, head stride D) <- x * E(cos[pos[t]]) + rotate_half(x) * E(sin[pos[t]]),
// each product and the sum rounded to E as torch does; cos/sin: float32 [P, D], D <= 512.
template <class E>
void rotary(E* q, int64_t q_ts, int64_t Hq, E* k, int64_t k_ts, int64_t Hk, const int64_t* pos, const float* cos,
            const float* sin, int64_t T, int64_t D) {
  const int64_t half = D / 2;
  pr::for_rows(T, T * (Hq + Hk) * D >= 16384, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cos + pos[t] * D;
      const float* s = sin + pos[t] * D;
      alignas(64) float cb[512], sb[512];
      int64_t e0 = 0;
#ifdef PR_BF16_DOT
      if constexpr (kBF16<E>) {
        for (; e0 + 16 <= D; e0 += 16) {
          _mm512_store_ps(cb + e0, rnd16(_mm512_loadu_ps(c + e0)));
          _mm512_store_ps(sb + e0, rnd16(_mm512_loadu_ps(s + e0)));
        }
      }
#endif
      for (int64_t d = e0; d < D; ++d) { cb[d] = round_to<E>(c[d]); sb[d] = round_to<E>(s[d]); }
      for (int which = 0; which < 2; ++which) {
        E* base = which == 0 ? q + t * q_ts : k + t * k_ts;
        const int64_t H = which == 0 ? Hq : Hk;
        for (int64_t h = 0; h < H; ++h) {
          E* x = base + h * D;
          int64_t d0 = 0;
#ifdef PR_BF16_DOT
          if constexpr (kBF16<E>) {
            for (; d0 + 16 <= half; d0 += 16) {  // the scalar loop's math, 16 lanes at a time
              const __m512 a = ld16(x + d0), b = ld16(x + d0 + half);
              const __m512 c1 = _mm512_loadu_ps(cb + d0), s1 = _mm512_loadu_ps(sb + d0);
              const __m512 c2 = _mm512_loadu_ps(cb + d0 + half), s2 = _mm512_loadu_ps(sb + d0 + half);
              st16(x + d0, _mm512_sub_ps(rnd16(_mm512_mul_ps(a, c1)), rnd16(_mm512_mul_ps(b, s1))));
              st16(x + d0 + half, _mm512_add_ps(rnd16(_mm512_mul_ps(b, c2)), rnd16(_mm512_mul_ps(a, s2))));
            }
          }
#endif
          for (int64_t d = d0; d < half; ++d) {
            const float a = ld(x[d]), b = ld(x[d + half]);
            st(x + d, round_to<E>(a * cb[d]) + round_to<E>(-b * sb[d]));
            st(x + d + half, round_to<E>(b * cb[d + half]) + round_to<E>(a * sb[d + half]));
          }
        }
      }
    }
  });
}

template <class E>
E* as(void* p) { return static_cast<E*>(p); }
template <class E>
const E* as(const void* p) { return static_cast<const E*>(p); }
}  // namespace

extern "C" {

// out[t] = RMSNorm(x[t]), x/out rows of H (row strides given).
int pr_rms_norm(int dtype, const void* x, int64_t x_ts, const void* w, void* out, int64_t o_ts, int64_t T, int64_t H,
                float eps) {
  return by_dtype(dtype, [&](auto e) {
    using E = decltype(e);
    rms_norm(as<E>(x), x_ts, as<E>(w), as<E>(out), o_ts, T, H, eps);
  });
}

// r[t] = x[t] + res[t] (rounded to the dtype); out[t] = RMSNorm(r[t]) (rows of H, all row-contiguous).
int pr_add_rms_norm(int dtype, const void* x, const void* res, const void* w, void* r_out, void* out, int64_t T,
                    int64_t H, float eps) {
  return by_dtype(dtype, [&](auto e) {
    using E = decltype(e);
    add_rms_norm(as<E>(x), as<E>(res), as<E>(w), as<E>(r_out), as<E>(out), T, H, eps);
  });
}

// out[t] = E(silu(gate[t])) * up[t] where gate/up are the halves of gu[t] (2 * I wide).
int pr_silu_mul(int dtype, const void* gu, int64_t g_ts, void* out, int64_t o_ts, int64_t T, int64_t I) {
  return by_dtype(dtype, [&](auto e) {
    using E = decltype(e);
    silu_mul(as<E>(gu), g_ts, as<E>(out), o_ts, T, I);
  });
}

// The rotary embedding of q [T, Hq, D] and k [T, Hk, D] in place (token strides q_ts, k_ts).
int pr_rotary(int dtype, void* q, int64_t q_ts, int64_t Hq, void* k, int64_t k_ts, int64_t Hk, const int64_t* pos,
              const float* cos, const float* sin, int64_t T, int64_t D) {
  return by_dtype(dtype, [&](auto e) {
    using E = decltype(e);
    rotary(as<E>(q), q_ts, Hq, as<E>(k), k_ts, Hk, pos, cos, sin, T, D);
  });
}
}
