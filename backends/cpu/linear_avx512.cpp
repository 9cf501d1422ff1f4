// bfloat16 linear on AVX-512F alone (no AVX512_BF16, no AMX: e.g. Ice Lake, Skylake-SP):
// y[M, N] = x[M, K] @ w[N, K]^T, x bfloat16 or float32, w bfloat16, y bfloat16.
//
// Weights are packed once at load (`pr_avx512_pack_bf16`) into the pair layout of
// linear_bf16.cpp, padded to N16 = N rounded up to 16 and K2 = K rounded up to 2 with zeros:
//   wp[N16 / 64][K2 / 2][64][2]: group g, pair kp, column c holds w[64g + c][2kp], w[64g + c][2kp + 1]
// (the last group narrower when N16 % 64 != 0). One 64-byte load is 16 columns x 1 pair; each
// 32-bit lane holds (w[c][2kp] low, w[c][2kp + 1] high), so the float32 values are one op each:
// `lane << 16` (the even k) and `lane & 0xffff0000` (the odd k). x is widened to float32 once per
// call (a row of K2 floats, zero-padded), and each (row, k) is a broadcast operand of the FMA.
// fp32 FMA accumulation, one rounding to bfloat16 (nearest even) at the end.
//
// Register blocking: up to 6 rows x 4 column blocks of 16 accumulators. A task is up to 64 rows
// x a column range of one group (4, 2 or 1 blocks: narrower when there are too few tasks for the
// threads); above 6 rows the pairs go in slices of KC (64 columns x KC pairs = 32 KiB, in L1),
// every row pass over a slice before the next, sums kept in `part`. Tasks are shared out in
// chunks (about 8 per thread) on the work-sharing pool (thread_pool.cpp).
// Without AVX-512F (or built with PR_PORTABLE) the kernel is absent: pr_avx512_available() is 0.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && !defined(PR_PORTABLE)
#include <immintrin.h>
#define PR_AVX512_LINEAR 1
#endif

#include "thread_pool.h"
#include "micro_pick.h"
#include "weight_prefetch.h"
#include "widen_dot.h"

#ifdef PR_AVX512_LINEAR
namespace {
constexpr int MR_MAX = 6, NC_MAX = 4;
constexpr int64_t MB = 64;   // rows per task
constexpr int64_t KC = 128;  // pairs per slice when a task has more than MR_MAX rows
constexpr int64_t PF = 32;   // pairs prefetched ahead (every line, into L1 or L2: weight_prefetch.h)

inline __m512 even(__m512i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)); }
inline __m512 odd(__m512i raw) {
  return _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int32_t(0xffff0000u))));
}

using pr_widen::to_bf16;

// Pairs [0, npairs) of rows [0, MR) of x (float32, row stride x_ts, the pair's two values at
// 2kp, 2kp + 1) times NC column blocks (w: the first block at pair 0, pair stride `wstep`
// elements). Sums start from `part` ([MR][64] floats) when `resume`, else zero; they end in y
// (row stride y_ts, bfloat16, the last block's first `tail` columns only) when `last`, else
// back in `part`.
template <int MR, int NC, bool L2>
void micro(const float* x, int64_t x_ts, const uint16_t* w, int64_t wstep, int64_t npairs, uint16_t* y,
           int64_t y_ts, int tail, float* part, bool resume, bool last) {
  __m512 acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = resume ? _mm512_loadu_ps(part + i * 64 + 16 * c) : _mm512_setzero_ps();
  for (int64_t kp = 0; kp < npairs; ++kp) {
    const uint16_t* wk = w + kp * wstep;
    pr::prefetch_lines<L2, NC>(wk + PF * wstep);
    const float* xk = x + 2 * kp;
    for (int c = 0; c < NC; ++c) {
      const __m512i raw = _mm512_loadu_si512(wk + c * 32);
      const __m512 we = even(raw), wo = odd(raw);
      for (int i = 0; i < MR; ++i) {
        acc[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i * x_ts]), we, acc[i][c]);
        acc[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(xk[i * x_ts + 1]), wo, acc[i][c]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < NC; ++c) {
      if (!last) {
        _mm512_storeu_ps(part + i * 64 + 16 * c, acc[i][c]);
        continue;
      }
      const __m256i h = to_bf16(acc[i][c]);
      uint16_t* dst = y + i * y_ts + 16 * c;
      if (c < NC - 1 || tail == 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
      } else {
        alignas(32) uint16_t tmp[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
        std::memcpy(dst, tmp, 2 * size_t(tail));
      }
    }
}

using Micro = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, int, float*,
                       bool, bool);

template <int MR, int NC, bool L2>
struct Avx512Micro {
  static constexpr Micro fn = micro<MR, NC, L2>;
};

Micro pick(int mr, int nc, bool l2) { return pr::pick_micro<Avx512Micro>(mr, nc, l2); }

struct Call {
  const float* x;   // [M, K2] float32
  const uint16_t* wp;
  uint16_t* y;
  int64_t y_ts, M, N, K2, nblocks, width, ncols, mchunks, per_chunk;
  bool l2;   // prefetch into L2 (else L1)
};

// One task: column task `col` (blocks [col * width, ...) of one group) x row chunk `mc`.
void run_task(const Call& c, int64_t col, int64_t mc, float* part) {
  const int64_t b0 = col * c.width, g = b0 / NC_MAX;
  const int64_t nc_all = std::min<int64_t>(c.nblocks - g * NC_MAX, NC_MAX);
  const int nc = int(std::min<int64_t>(c.width, c.nblocks - b0));
  const int64_t npairs = c.K2 / 2, wstep = 32 * nc_all;
  const uint16_t* w = c.wp + g * 64 * c.K2 + (b0 - g * NC_MAX) * 32;
  const int64_t r0 = mc * MB, r1 = std::min(c.M, r0 + MB);
  const int tail = int(std::min<int64_t>(16, c.N - (b0 + nc - 1) * 16));
  const int64_t kc = r1 - r0 > MR_MAX ? KC : npairs;
  for (int64_t k0 = 0; k0 < npairs; k0 += kc) {
    const int64_t nk = std::min(kc, npairs - k0);
    const bool resume = k0 > 0, last = k0 + nk >= npairs;
    for (int64_t m0 = r0; m0 < r1; m0 += MR_MAX) {
      const int mr = int(std::min<int64_t>(r1 - m0, MR_MAX));
      pick(mr, nc, c.l2)(c.x + m0 * c.K2 + 2 * k0, c.K2, w + k0 * wstep, wstep, nk, c.y + m0 * c.y_ts + b0 * 16, c.y_ts,
                   tail, part + (m0 - r0) * 64, resume, last);
    }
  }
}

void run_chunk(void* ctx, int64_t chunk, int) {
  const Call& c = *static_cast<const Call*>(ctx);
  const int64_t ntasks = c.ncols * c.mchunks;
  alignas(64) float part[MB * 64];
  for (int64_t t = chunk * c.per_chunk, t1 = std::min(ntasks, t + c.per_chunk); t < t1; ++t)
    run_task(c, t / c.mchunks, t % c.mchunks, part);   // a column's row chunks in turn: its weights stay cached
}

// x rows -> float32 [M, K2] (the odd K's last column 0).
template <class T>
void widen_rows(const T* x, int64_t x_ts, int64_t M, int64_t K, int64_t K2, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const T* src = x + m * x_ts;
    float* dst = out + m * K2;
    if constexpr (sizeof(T) == 4) {
      std::memcpy(dst, src, 4 * size_t(K));
    } else {
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        _mm512_storeu_ps(dst + k, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k))), 16)));
      for (; k < K; ++k) {
        const uint32_t bits = uint32_t(src[k]) << 16;
        std::memcpy(dst + k, &bits, 4);
      }
    }
    if (K2 > K) dst[K] = 0.0f;
  }
}
}  // namespace
#endif

extern "C" {

// 1 when the AVX-512F linear is compiled in (not PR_PORTABLE, the build CPU has AVX-512F), else 0.
int pr_avx512_available() {
#ifdef PR_AVX512_LINEAR
  return 1;
#else
  return 0;
#endif
}

// Elements of the packed copy of an [N, K] weight: N rounded up to 16 times K rounded up to 2.
int64_t pr_avx512_packed_size(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * ((K + 1) / 2 * 2); }

// w[N, K] (row-major bfloat16) -> wp (pr_avx512_packed_size(N, K) elements), the layout above,
// zeros in the padding.
void pr_avx512_pack_bf16(const uint16_t* w, uint16_t* wp, int64_t N, int64_t K) {
  const int64_t N16 = (N + 15) / 16 * 16, K2 = (K + 1) / 2 * 2, npairs = K2 / 2, ngroups = (N16 + 63) / 64;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < ngroups; ++g) {
    const int64_t n0 = 64 * g, nc = std::min<int64_t>(N16 - n0, 64);
    uint16_t* dst = wp + n0 * K2;
    for (int64_t kp = 0; kp < npairs; ++kp)
      for (int64_t c = 0; c < nc; ++c)
        for (int64_t j = 0; j < 2; ++j) {
          const int64_t n = n0 + c, k = 2 * kp + j;
          dst[(kp * nc + c) * 2 + j] = n < N && k < K ? w[n * K + k] : uint16_t(0);
        }
  }
}

// y[m, n] (bfloat16, row stride y_ts) for m < M, n < N; x rows of K (float32 when x_f32, else
// bfloat16) with row stride x_ts and unit column stride; wp packed by pr_avx512_pack_bf16.
// Returns 0 on success, 1 when not compiled in or M < 1.
int pr_avx512_linear_bf16(const void* x, int64_t x_ts, int x_f32, const uint16_t* wp, uint16_t* y, int64_t y_ts,
                          int64_t M, int64_t N, int64_t K) {
#ifdef PR_AVX512_LINEAR
  if (M < 1 || N < 1 || K < 1) return 1;
  const int64_t K2 = (K + 1) / 2 * 2;
  thread_local std::vector<float> xf;   // the caller's: the pool's helpers only read it during the call
  if (int64_t(xf.size()) < M * K2) xf.resize(size_t(M * K2));
  if (x_f32)
    widen_rows(static_cast<const float*>(x), x_ts, M, K, K2, xf.data());
  else
    widen_rows(static_cast<const uint16_t*>(x), x_ts, M, K, K2, xf.data());
  const int64_t nblocks = (N + 15) / 16, mchunks = (M + MB - 1) / MB;
  const int64_t threads = N * K >= 65536 ? pr::pool_helpers() + 1 : 1;
  int64_t width = NC_MAX;   // narrower column tasks while there are too few tasks for the threads
  while (width > 1 && mchunks * ((nblocks + width - 1) / width) < 4 * threads) width /= 2;
  const int64_t ncols = (nblocks + width - 1) / width, ntasks = ncols * mchunks;
  Call c{xf.data(), wp, y, y_ts, M, N, K2, nblocks, width, ncols, mchunks, 0, pr::weight_prefetch_to_l2()};
  c.per_chunk = threads > 1 ? std::max<int64_t>(1, ntasks / (8 * threads)) : ntasks;
  pr::parallel_for(threads > 1 ? (ntasks + c.per_chunk - 1) / c.per_chunk : 1, run_chunk, &c);
  return 0;
#else
  (void)x, (void)x_ts, (void)x_f32, (void)wp, (void)y, (void)y_ts, (void)M, (void)N, (void)K;
  return 1;
#endif
}
}
