// Greedy sampling's argmax over float32 logits rows, torch.argmax's rule: the
// first index of the maximum, a NaN counting as the maximum (its first index).
// AVX-512: one pass keeps the running maximum and whether a NaN was seen, a
// second finds the first lane equal to it (the row is in L2 by then). Rows are
// shared out through `thread_pool.cpp` when there are several.

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) && !defined(PR_PORTABLE)
#include <immintrin.h>
#define PR_ARGMAX_AVX512 1
#endif

namespace pr {  // thread_pool.cpp
using ChunkFn = void (*)(void* ctx, int64_t chunk, int worker);
void parallel_for(int64_t n, ChunkFn fn, void* ctx);
}  // namespace pr

namespace {
int64_t argmax_row(const float* x, int64_t V) {
  int64_t j = 0;
#ifdef PR_ARGMAX_AVX512
  if (V >= 16) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; j + 16 <= V; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, v);
    }
    float best = _mm512_reduce_max_ps(mx);
    for (int64_t t = j; t < V; ++t) {
      if (std::isnan(x[t])) nan = 1;
      else if (x[t] > best) best = x[t];
    }
    if (!nan) {
      const __m512 b = _mm512_set1_ps(best);
      for (int64_t i = 0; i + 16 <= V; i += 16) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), b, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
      }
      for (int64_t t = V - V % 16; t < V; ++t)
        if (x[t] == best) return t;
    }
    j = 0;  // a NaN: the scalar scan below returns the first one
  }
#endif
  int64_t arg = 0;
  float best = x[0];
  if (std::isnan(best)) return 0;
  for (j = 1; j < V; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > best) {
      best = x[j];
      arg = j;
    }
  }
  return arg;
}

struct ArgmaxCall {
  const float* x;
  int64_t x_ts, V;
  int64_t* out;
};

void argmax_chunk(void* ctx, int64_t r, int) {
  const ArgmaxCall& c = *static_cast<const ArgmaxCall*>(ctx);
  c.out[r] = argmax_row(c.x + r * c.x_ts, c.V);
}
}  // namespace

extern "C" {
// out[r] = argmax of row r of x (R rows of V >= 1 floats, row stride x_ts).
void pr_argmax_f32(const float* x, int64_t x_ts, int64_t R, int64_t V, int64_t* out) {
  ArgmaxCall c{x, x_ts, V, out};
  pr::parallel_for(R, argmax_chunk, &c);
}
}
