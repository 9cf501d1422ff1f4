// Small-M bfloat16 linear on AVX512_BF16 (vdpbf16ps), for CPUs without AMX:
// y[M, N] = x[M, K] @ w[N, K]^T.
//
// Decode steps multiply a few rows by every weight of the model, so they are
// bound by reading the weights: each weight is streamed from memory exactly once
// per call. Weights are packed at load time (`pr_dpbf16_pack_bf16`) into VNNI
// pairs, 64 output features per group, one contiguous stream per group:
//   wp[N / 64][K / 2][64][2]: group g, pair kp, column c holds w[64g + c][2kp], w[64g + c][2kp + 1]
// so one 64-byte load is 16 columns x 1 pair, and one vdpbf16ps with the
// broadcast pair (x[m][2kp], x[m][2kp + 1]) adds it into 16 fp32 sums.
//
// Register blocking: up to 6 rows x 4 column blocks of accumulators; a task is
// one group (64 output features) over every row (from ROW_SPLIT_M rows, for shapes
// with few groups, over half of them), so what a task streams from
// memory (prefetched PF pairs ahead, every line of them, into L1 or L2 as measured fastest
// on this machine: weight_prefetch.h) is reused by its later row passes: above 6
// rows the group's pairs go in slices of 128 (32 KiB, in L1), every row pass over
// a slice before the next. Measured >= oneDNN at 1-64 rows for SmolLM2's shapes.
// Threads: the tasks are shared out in chunks (about 8 per thread) through
// `thread_pool.cpp`, so a thread descheduled on a shared host delays only the
// chunk it holds while the others take the rest. fp32 accumulation, one rounding
// to bfloat16 (nearest even) at the end.

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(PR_PORTABLE)
#include <immintrin.h>
#define PR_DPBF16 1
#endif

#include "thread_pool.h"
#include "micro_pick.h"
#include "weight_prefetch.h"

#ifdef PR_DPBF16
namespace {
constexpr int MR_MAX = 6, NC_MAX = 4;
constexpr int64_t KC = 128, KB_MAX_M = 64;  // K slices (pairs) for M in (MR_MAX, KB_MAX_M]
constexpr int64_t PF = 32;  // pairs prefetched ahead (PF * 256 bytes of a full group)
constexpr int64_t ROW_SPLIT_M = 32;  // rows from which a group's rows may be split between two tasks

// rows [0, MR) of x (row stride x_ts) times NC column blocks starting at `w`
// (block stride bstride elements) -> y (row stride y_ts), columns [0, 16 * NC).
// Pairs [0, npairs) of rows [0, MR) of x (row stride x_ts) times NC column blocks of a
// group (w: its first pair here, `nc_all` blocks wide). Sums start from `part`
// ([MR][64] floats) when `resume`, else zero; they end in y (row stride y_ts,
// rounded to bfloat16) when `last`, else back in `part`.
template <int MR, int NC, bool L2>
void micro(const uint16_t* x, int64_t x_ts, const uint16_t* w, int64_t nc_all, int64_t npairs, uint16_t* y,
           int64_t y_ts, float* part, bool resume, bool last) {
  __m512 acc[MR][NC];
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = resume ? _mm512_loadu_ps(part + i * 64 + 16 * c) : _mm512_setzero_ps();
  const int64_t wstep = 32 * nc_all;
  for (int64_t kp = 0; kp < npairs; ++kp) {
    const uint16_t* wk = w + kp * wstep;
    pr::prefetch_lines<L2, NC>(wk + PF * wstep);
    __m512bh wv[NC];
    for (int c = 0; c < NC; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(wk + c * 32);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * x_ts + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], xb, wv[c]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < NC; ++c) {
      if (last)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * y_ts + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[i][c]));
      else
        _mm512_storeu_ps(part + i * 64 + 16 * c, acc[i][c]);
    }
}

using Micro = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t, float*, bool,
                       bool);

template <int MR, int NC, bool L2>
struct DpbMicro {
  static constexpr Micro fn = micro<MR, NC, L2>;
};

Micro pick(int mr, int nc, bool l2) { return pr::pick_micro<DpbMicro>(mr, nc, l2); }

struct Call {
  const uint16_t* x;
  int64_t x_ts;
  const uint16_t* wp;
  uint16_t* y;
  int64_t y_ts, M, nblocks, npairs, per_chunk;
  bool l2;         // prefetch into L2 (else L1)
  int64_t mparts;  // row parts per group (2: a task is a group x half of the rows)
};

// Tasks [chunk * per_chunk, ...): each one group of up to NC_MAX blocks times every row, or
// (mparts 2) times half of them: the halves of a group are neighbouring tasks, so two threads
// take them together and the group streams from memory once.
// More than MR_MAX rows: the group's pairs go in slices of KC (64 columns x KC pairs
// = 32 KiB, in L1) with every row pass over a slice before the next, sums kept in `part`.
void run_chunk(void* ctx, int64_t chunk, int) {
  const Call& c = *static_cast<const Call*>(ctx);
  const int64_t ntasks = (c.nblocks + NC_MAX - 1) / NC_MAX * c.mparts;
  const int64_t t1 = std::min(ntasks, (chunk + 1) * c.per_chunk);
  const int64_t kc = c.M > MR_MAX && c.M <= KB_MAX_M ? KC : c.npairs;
  alignas(64) float part[KB_MAX_M * 64];
  for (int64_t t = chunk * c.per_chunk; t < t1; ++t) {
    const int64_t nb0 = t / c.mparts * NC_MAX, half = t % c.mparts;
    const int64_t r0 = c.M * half / c.mparts, r1 = c.M * (half + 1) / c.mparts;
    const int nc = int(std::min<int64_t>(c.nblocks - nb0, NC_MAX));
    const uint16_t* w = c.wp + nb0 * 32 * c.npairs;
    for (int64_t k0 = 0; k0 < c.npairs; k0 += kc) {
      const int64_t nk = std::min(kc, c.npairs - k0);
      const bool resume = k0 > 0, last = k0 + nk >= c.npairs;
      for (int64_t m0 = r0; m0 < r1; m0 += MR_MAX) {
        const int mr = int(std::min<int64_t>(r1 - m0, MR_MAX));
        float* pm = part + (kc < c.npairs ? m0 * 64 : 0);
        pick(mr, nc, c.l2)(c.x + m0 * c.x_ts + 2 * k0, c.x_ts, w + k0 * 32 * nc, nc, nk, c.y + m0 * c.y_ts + nb0 * 16,
                     c.y_ts, pm, resume, last);
      }
    }
  }
}
}  // namespace
#endif

extern "C" {

// Where the pool's bfloat16 linears prefetch their weights (weight_prefetch.h): 0 L1, 1 L2;
// returns the previous level.
int pr_set_linear_prefetch(int l2) { return pr::weight_prefetch_l2.exchange(l2 ? 1 : 0); }
int pr_linear_prefetch() { return pr::weight_prefetch_to_l2() ? 1 : 0; }

// 1 when the AVX512_BF16 linear is compiled in (not PR_PORTABLE, the build CPU has it), else 0.
int pr_dpbf16_available() {
#ifdef PR_DPBF16
  return 1;
#else
  return 0;
#endif
}

// w[N, K] (row-major) -> wp[N / 64][K / 2][64][2] (the last group narrower when N % 64 != 0):
// group g, pair kp holds w[64g + c][2kp], w[64g + c][2kp + 1] for its columns c.
// Needs N % 16 == 0 and K % 2 == 0.
void pr_dpbf16_pack_bf16(const uint16_t* w, uint16_t* wp, int64_t N, int64_t K) {
  const int64_t npairs = K / 2, ngroups = (N + 63) / 64;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < ngroups; ++g) {
    const int64_t n0 = 64 * g, nc = (N - n0 < 64 ? N - n0 : 64);
    uint16_t* dst = wp + n0 * K;
    for (int64_t kp = 0; kp < npairs; ++kp)
      for (int64_t c = 0; c < nc; ++c) {
        dst[(kp * nc + c) * 2] = w[(n0 + c) * K + 2 * kp];
        dst[(kp * nc + c) * 2 + 1] = w[(n0 + c) * K + 2 * kp + 1];
      }
  }
}

// y[m, n] (row stride y_ts) for m < M, n < N; x rows of K with stride x_ts; wp packed
// by pr_dpbf16_pack_bf16 (N % 16 == 0, K % 2 == 0). Returns 0 on success, 1 when not
// compiled in or the shapes are not supported.
int pr_dpbf16_linear_bf16(const uint16_t* x, int64_t x_ts, const uint16_t* wp, uint16_t* y, int64_t y_ts,
                          int64_t M, int64_t N, int64_t K) {
#ifdef PR_DPBF16
  if (M < 1 || N % 16 || K % 2) return 1;
  const int64_t groups = (N / 16 + NC_MAX - 1) / NC_MAX;
  const int64_t threads = N * K >= 65536 ? pr::pool_helpers() + 1 : 1;
  // compute-bound row counts with few groups (e.g. 9 for 576 outputs: 5 vs 4 on two threads) also
  // split the rows in two; fewer rows stream the weights, which one pass over each group serves best
  const int64_t mparts = threads > 1 && M >= ROW_SPLIT_M && groups < 8 * threads ? 2 : 1;
  Call c{x, x_ts, wp, y, y_ts, M, N / 16, K / 2, 0, pr::weight_prefetch_to_l2(), mparts};
  const int64_t ntasks = groups * mparts;
  c.per_chunk = threads > 1 ? std::max<int64_t>(1, ntasks / (8 * threads)) : ntasks;
  pr::parallel_for(threads > 1 ? (ntasks + c.per_chunk - 1) / c.per_chunk : 1, run_chunk, &c);
  return 0;
#else
  (void)x, (void)x_ts, (void)wp, (void)y, (void)y_ts, (void)M, (void)N, (void)K;
  return 1;
#endif
}
}
