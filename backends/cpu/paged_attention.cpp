// CPU paged attention kernel: write this step's K/V into the paged cache, then
// attend the queries of requests [r_begin, r_end) to their cached context,
// reading K/V straight from the cache blocks (no per-layer gather copy).
//
// Plain C++ (no torch headers) so it builds in about a second; called through
// ctypes with raw pointers. Threads: OpenMP, which resolves to the libgomp that
// torch already loaded, so torch.set_num_threads governs it too.
//
// Layout (elements):
//   q      [T, Hq, D]     token stride q_ts, head stride D
//   k, v   [T, Hkv, D]    token strides k_ts / v_ts, head stride D
//   cache  [2, NB, bs, Hkv, D] contiguous (0: keys, 1: values)
//   out    [T, Hq, D]     token stride o_ts, head stride D
//   qsl    [R + 1] int32, seq_lens [R] int32, block_tables [R, bt_stride] int32
// Query i of request r sits at position seq_lens[r] - n_q + i; it sees keys at
// positions p <= its own and, with a sliding window w > 0, p > pos - w. With a logit
// soft cap c > 0 (Gemma 2) each scaled score s becomes c * tanh(s / c) first.
// Requests with no queries or seq_len 0 (padding) are skipped; output rows of
// tokens outside [qsl[r_begin], qsl[r_end]) are not touched.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "bfloat16.h"
#include "simd_exp.h"
#include "thread_pool.h"

// PR_F32_AVX2: the float32 decode's AVX2 + FMA path (decode_block_f32); not in the portable build.
#if defined(__AVX2__) && defined(__FMA__) && !defined(PR_PORTABLE)
#include <immintrin.h>
#define PR_F32_AVX2 1
#endif

namespace {

constexpr int64_t QT = 16;  // queries per tile

// Where NextBlock prefetches: 0 into L1 (`prefetcht0`), 1 into L2 (`prefetcht1`; on Zen 4 the
// decode of 64 requests ran ~1.5x faster so, design-measurements.md). Chosen by timing both on the
// machine (`decode_prefetch.py`), set with pr_set_decode_prefetch; read once per block.
std::atomic<int> g_prefetch_l2{0};

// Attention logit soft cap (Gemma 2): cap * tanh(s / cap) on n scores in place (cap > 0). tanh as
// simd_exp.h's tanh16, branch-free so the loop vectorises: odd Taylor polynomial below |x| = 0.3,
// else (1 - e) / (1 + e) with e = exp(-2|x|) (no overflow), the sign put back; -inf stays -inf.
inline void softcap_scores(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap, NEG = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const float x = s[j] * inv, a = std::fabs(x), a2 = a * a;
    const float e = fast_exp(-2.f * a);
    const float big = (1.f - e) / (1.f + e);
    const float small = a + a * a2 * (-1.f / 3.f + a2 * (2.f / 15.f + a2 * (-17.f / 315.f + a2 * (62.f / 2835.f))));
    s[j] = s[j] == NEG ? NEG : cap * std::copysign(a < 0.3f ? small : big, x);
  }
}

#ifdef PR_BF16_DOT
// dot(q, k) of two bfloat16 rows of 32 * n elements, fp32 accumulation (AVX512-BF16).
inline float dot_bf16(const uint16_t* q, const uint16_t* k, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; ++c)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + 32 * c),
                           (__m512bh)_mm512_loadu_si512(k + 32 * c));
  return _mm512_reduce_add_ps(acc);
}

// r[j] = horizontal sum of v[j], for 16 vectors (transpose-and-add tree).
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], w[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}

// Scores of one bfloat16 query row against up to 16 key rows (stride `row`),
// lanes [ja, jb) valid (ja < jb); returns them scaled in a vector, invalid lanes -inf.
// Fully unrolled, no branches: a lane outside [ja, jb) re-reads the nearest valid
// row (its score is masked), so only rows [ja, jb) are ever read.
template <int NC>  // D = 32 * NC
inline __m512 scores16(const uint16_t* qrow, const uint16_t* k, int64_t row, int64_t ja, int64_t jb,
                       float scale) {
  __m512bh qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qrow + 32 * c);
  const bool full = ja == 0 && jb == 16;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    const uint16_t* kr = k + (full ? j : std::min<int64_t>(std::max<int64_t>(j, ja), jb - 1)) * row;
    acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
    for (int c = 1; c < NC; ++c)
      acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
  }
  const __mmask16 valid = __mmask16(((1u << jb) - 1u) & ~((1u << ja) - 1u));
  return _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                            hsum16(acc), _mm512_set1_ps(scale));
}

// One row's online-softmax update over up to 16 keys: m, l, acc (D = 16 * NV floats).
template <int NV>
inline void update16(__m512 s, int64_t ja, int64_t jb, const float* v, int64_t row, float* m,
                     float* l, float* acc) {
  const __mmask16 valid = __mmask16(((1u << jb) - 1u) & ~((1u << ja) - 1u));
  const float mx = std::max(*m, _mm512_mask_reduce_max_ps(valid, s));
  const float corr = fast_exp(*m - mx);
  *m = mx;
  const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
  *l = *l * corr + _mm512_reduce_add_ps(p);
  alignas(64) float pj[16];
  _mm512_store_ps(pj, p);
  __m512 a[NV];
  const __m512 c = _mm512_set1_ps(corr);
  for (int i = 0; i < NV; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), c);
  for (int64_t j = ja; j < jb; ++j) {
    const __m512 b = _mm512_set1_ps(pj[j]);
    for (int i = 0; i < NV; ++i) a[i] = _mm512_fmadd_ps(b, _mm512_loadu_ps(v + j * row + 16 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

template <typename T>
void write_kv(const T* k, int64_t k_ts, const T* v, int64_t v_ts, T* cache, int64_t num_slots,
              const int64_t* slots, int64_t num_tokens, int64_t Hkv, int64_t D) {
  const int64_t row = Hkv * D;
  T* kc = cache;
  T* vc = cache + num_slots * row;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t s = slots[t];
    std::memcpy(kc + s * row, k + t * k_ts, sizeof(T) * row);
    std::memcpy(vc + s * row, v + t * v_ts, sizeof(T) * row);
  }
}

// One work item = one request's tile of up to QT queries, all heads: each cache
// block (all KV heads of bs tokens, contiguous) is read once, sequentially.
template <typename T>
void attend(const T* q, int64_t q_ts, const T* cache, int64_t NB, int64_t bs, int64_t Hkv,
            int64_t D, const int32_t* qsl, const int32_t* seq_lens, const int32_t* bt,
            int64_t bt_stride, T* out, int64_t o_ts, int64_t r_begin, int64_t r_end, int64_t Hq,
            float scale, int64_t window, float softcap) {
  const int64_t G = Hq / Hkv;
  const int64_t row = Hkv * D;  // elements of one token's keys (all heads)
  const T* kc = cache;
  const T* vc = cache + NB * bs * row;
  const float NEG = -std::numeric_limits<float>::infinity();
#ifdef PR_BF16_DOT
  const bool bf16_dot = std::is_same<T, uint16_t>::value && D % 32 == 0;
  const bool vec16 = bs <= 16 && (D == 64 || D == 128);
#else
  const bool bf16_dot = false;
#endif
  // work items: (request, query tile)
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t nq = int64_t(qsl[r + 1]) - qsl[r];
    if (nq <= 0 || seq_lens[r] <= 0) continue;
    for (int64_t t0 = 0; t0 < nq; t0 += QT) items.emplace_back(r, t0);
  }
  const int64_t n_items = int64_t(items.size());
#pragma omp parallel if (n_items > 1)
  {
    std::vector<float> qf(QT * Hq * D), acc(QT * Hq * D), kf(bs * row), vf(bs * row), s(bs);
    std::vector<float> m(QT * Hq), l(QT * Hq);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const int64_t r = items[it].first, t0 = items[it].second;
      const int64_t q0 = qsl[r], nq = int64_t(qsl[r + 1]) - q0, L = seq_lens[r];
      const int32_t* table = bt + r * bt_stride;
      const int64_t nt = std::min(QT, nq - t0), rows = nt * Hq;  // row = i * Hq + head
      const int64_t pos_first = L - nq + t0, pos_last = pos_first + nt - 1;
      if (!bf16_dot)
        for (int64_t i = 0; i < nt; ++i) {
          const T* src = q + (q0 + t0 + i) * q_ts;
          for (int64_t d = 0; d < Hq * D; ++d) qf[i * Hq * D + d] = ld(src[d]) * scale;
        }
      std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
      std::fill(m.begin(), m.begin() + rows, NEG);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos_first - window + 1) : 0;
      const int64_t hi = pos_last + 1;  // keys [lo, hi)
      for (int64_t b = lo / bs; b * bs < hi; ++b) {
        const int64_t blk = table[b];
        const int64_t j0 = std::max(b * bs, lo), j1 = std::min((b + 1) * bs, hi), nj = j1 - j0;
        const T* kb = kc + (blk * bs + (j0 - b * bs)) * row;
        const T* vb = vc + (blk * bs + (j0 - b * bs)) * row;
        if ((b + 1) * bs < hi) {  // the next block lives elsewhere: prefetch it
          const int64_t nxt = table[b + 1];
          const char* kn = reinterpret_cast<const char*>(kc + nxt * bs * row);
          const char* vn = reinterpret_cast<const char*>(vc + nxt * bs * row);
          for (int64_t off = 0; off < int64_t(sizeof(T)) * bs * row; off += 64) {
            __builtin_prefetch(kn + off);
            __builtin_prefetch(vn + off);
          }
        }
        for (int64_t e = 0; e < nj * row; ++e) vf[e] = ld(vb[e]);
        if (!bf16_dot)
          for (int64_t e = 0; e < nj * row; ++e) kf[e] = ld(kb[e]);
        for (int64_t rr = 0; rr < rows; ++rr) {
          const int64_t i = rr / Hq, h = rr % Hq, hk = h / G;
          const int64_t pos = pos_first + i;
          // visible keys of this row within the block: [ja, jb)
          const int64_t ja = std::max<int64_t>(0, (window > 0 ? pos - window + 1 : 0) - j0);
          const int64_t jb = std::min<int64_t>(nj, pos + 1 - j0);
          if (jb <= ja) continue;
#ifdef PR_BF16_DOT
          if (vec16 && bf16_dot) {
            const uint16_t* qb = reinterpret_cast<const uint16_t*>(q) + (q0 + t0 + i) * q_ts + h * D;
            const uint16_t* kh = reinterpret_cast<const uint16_t*>(kb) + hk * D;
            const float* vh = &vf[hk * D];
            __m512 sc = D == 64 ? scores16<2>(qb, kh, row, ja, jb, scale) : scores16<4>(qb, kh, row, ja, jb, scale);
            if (softcap > 0.f) sc = softcap16(sc, softcap);
            if (D == 64) update16<4>(sc, ja, jb, vh, row, &m[rr], &l[rr], &acc[rr * D]);
            else update16<8>(sc, ja, jb, vh, row, &m[rr], &l[rr], &acc[rr * D]);
            continue;
          }
#endif
          float mx = m[rr];
#ifdef PR_BF16_DOT
          if (bf16_dot) {
            const uint16_t* qb = reinterpret_cast<const uint16_t*>(q) + (q0 + t0 + i) * q_ts + h * D;
            const uint16_t* kh = reinterpret_cast<const uint16_t*>(kb) + hk * D;
            for (int64_t j = ja; j < jb; ++j) s[j] = dot_bf16(qb, kh + j * row, D / 32) * scale;
          } else
#endif
          {
            const float* qr = &qf[(i * Hq + h) * D];
            for (int64_t j = ja; j < jb; ++j) {
              const float* kr = &kf[j * row + hk * D];
              float dot = 0.f;
              for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
              s[j] = dot;
            }
          }
          if (softcap > 0.f) softcap_scores(&s[ja], jb - ja, softcap);
          for (int64_t j = ja; j < jb; ++j) mx = std::max(mx, s[j]);
          const float corr = fast_exp(m[rr] - mx);
          m[rr] = mx;
          float sum = 0.f;
          for (int64_t j = ja; j < jb; ++j) {
            const float p = fast_exp(s[j] - mx);
            s[j] = p;
            sum += p;
          }
          l[rr] = l[rr] * corr + sum;
          float* ar = &acc[rr * D];
          for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
          for (int64_t j = ja; j < jb; ++j) {
            const float p = s[j];
            const float* vr = &vf[j * row + hk * D];
            for (int64_t d = 0; d < D; ++d) ar[d] += p * vr[d];
          }
        }
      }
      for (int64_t rr = 0; rr < rows; ++rr) {
        const int64_t i = rr / Hq, h = rr % Hq;
        const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
        T* dst = out + (q0 + t0 + i) * o_ts + h * D;
        const float* ar = &acc[rr * D];
        for (int64_t d = 0; d < D; ++d) st(dst + d, ar[d] * inv);
      }
    }
  }
}

// ---- decode: one query per request, parallel over (request, KV heads, context split) ----
// Each work item reads the keys and values of a range of KV heads over a key range
// once, block by block (prefetching the next block while it computes on the
// current one), for the G query heads that share each KV head. The bfloat16 path
// spreads the next block's prefetches over the keys it computes, in address order
// (`NextBlock`): a whole block's prefetches at once fill the core's miss buffers and
// stall the loads behind them until they land, so fetch and compute add up instead of
// overlapping; address order beat a row of each head per key (both measured:
// benchmarks/results/design-measurements.md). With at least
// twice as many requests as threads an item is a request (all heads: each block's
// rows are read whole); otherwise an item is one (request, KV head) pair (ranges of heads per item
// read longer runs of each token's row but ran slower: 1 x 96 and 1 x 288 keys, 32 heads of 64,
// float32, Zen 3), and when those are fewer than twice the threads long contexts are split into
// ranges of whole blocks: each split leaves (max, sum, unnormalised output) per query head
// and a final pass merges them. float32 runs 8 keys at a time on AVX2 (`decode_block_f32`). Items run through `pr::run_items`: on the work-sharing pool
// (`thread_pool.cpp`: a stalled thread holds one item) in steps where torch has one thread (decode
// steps), else on OpenMP, whose team such a (mixed) step keeps awake: the pool run right after a
// oneDNN call shared the cores with the team's spin (64 requests x 200 keys: 1.09-1.30 ms, OpenMP
// 0.66-0.74 ms, 2 Zen 4 cores).
constexpr int64_t DEC_MAX_GD = 16384;  // heads * G * D floats of accumulators per item (on the stack)
constexpr int64_t DEC_MIN_SPLIT = 64;  // keys per split at least

struct DecodeItem {
  int64_t r, h0, h1, k0, k1, part;  // request, KV heads [h0, h1), key positions [k0, k1), partial slot (-1: final)
};

template <typename T>
struct DecodeCall {
  const T *q, *kc, *vc;
  T* out;
  int64_t q_ts, o_ts, bs, Hkv, D, G, bt_stride;
  const int32_t *qsl, *seq_lens, *bt;
  float scale, softcap;  // softcap > 0: scores become softcap * tanh(score / softcap)
  std::vector<DecodeItem> items;
  float* part;  // [n_parts][G][D + 2]: acc, m, l
};

// Scores of G query rows (q, head stride D) against keys [ja, jb) of a block (rows
// k + j * row) and the online-softmax update of m, l, acc[G][D]; generic loops.
template <typename T>
inline void decode_block(const T* q, const T* k, const T* v, int64_t row, int64_t ja, int64_t jb, int64_t G,
                         int64_t D, float scale, float softcap, float* m, float* l, float* acc) {
  float s[64];
  for (int64_t j0 = ja; j0 < jb; j0 += 64) {
    const int64_t j1 = std::min(jb, j0 + 64);
    for (int64_t g = 0; g < G; ++g) {
      const T* qg = q + g * D;
      float mx = m[g];
      for (int64_t j = j0; j < j1; ++j) {
        const T* kr = k + j * row;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += ld(qg[d]) * ld(kr[d]);
        s[j - j0] = dot * scale;
      }
      if (softcap > 0.f) softcap_scores(s, j1 - j0, softcap);
      for (int64_t j = 0; j < j1 - j0; ++j) mx = std::max(mx, s[j]);
      const float corr = fast_exp(m[g] - mx);
      m[g] = mx;
      float sum = 0.f;
      for (int64_t j = 0; j < j1 - j0; ++j) {
        s[j] = fast_exp(s[j] - mx);
        sum += s[j];
      }
      l[g] = l[g] * corr + sum;
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= corr;
      for (int64_t j = j0; j < j1; ++j) {
        const T* vr = v + j * row;
        const float p = s[j - j0];
        for (int64_t d = 0; d < D; ++d) a[d] += p * ld(vr[d]);
      }
    }
  }
}

#ifdef PR_F32_AVX2
// The same for float32 with D = 8 * NV, 8 keys at a time on AVX2 + FMA: each key's dot product in its
// own vector, the 8 summed by a transposing horizontal add into one vector of scores (the generic
// loops reduce each key's 8 lanes on their own), the softmax update per 8 keys, the PV sum into
// accumulators held in registers. Keys past jb in the last group of 8 reuse row jb - 1 (not counted).
inline __m256 hsum8x8(const __m256* d) {  // lane j = the sum of d[j]'s 8 lanes
  const __m256 t0 = _mm256_hadd_ps(d[0], d[1]), t1 = _mm256_hadd_ps(d[2], d[3]);
  const __m256 t2 = _mm256_hadd_ps(d[4], d[5]), t3 = _mm256_hadd_ps(d[6], d[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hadd8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

template <int NV>
inline void decode_block_f32(const float* q, const float* k, const float* v, int64_t row, int64_t ja, int64_t jb,
                             int64_t G, float scale, float softcap, float* m, float* l, float* acc) {
  const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const __m256 NEG = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * 8 * NV;
    float* a = acc + g * 8 * NV;
    __m256 o[NV];
    for (int i = 0; i < NV; ++i) o[i] = _mm256_loadu_ps(a + 8 * i);
    float mg = m[g], lg = l[g];
    for (int64_t j0 = ja; j0 < jb; j0 += 8) {
      const int64_t n = std::min<int64_t>(8, jb - j0);
      __m256 d[8];
      for (int j = 0; j < 8; ++j) {
        const float* kr = k + (j0 + std::min<int64_t>(j, n - 1)) * row;
        d[j] = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(kr));
        for (int i = 1; i < NV; ++i) d[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * i), _mm256_loadu_ps(kr + 8 * i), d[j]);
      }
      __m256 sv = _mm256_mul_ps(hsum8x8(d), _mm256_set1_ps(scale));
      if (softcap > 0.f) {
        alignas(32) float s[8];
        _mm256_store_ps(s, sv);
        softcap_scores(s, 8, softcap);
        sv = _mm256_load_ps(s);
      }
      const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps(float(n)), _CMP_LT_OQ);
      sv = _mm256_blendv_ps(NEG, sv, valid);
      const float mx = std::max(mg, hmax8(sv));
      const float corr = fast_exp(mg - mx);
      mg = mx;
      const __m256 pv = _mm256_and_ps(exp8(_mm256_sub_ps(sv, _mm256_set1_ps(mx))), valid);
      lg = lg * corr + hadd8(pv);
      if (corr != 1.f)
        for (int i = 0; i < NV; ++i) o[i] = _mm256_mul_ps(o[i], _mm256_set1_ps(corr));
      alignas(32) float p[8];
      _mm256_store_ps(p, pv);
      for (int64_t j = 0; j < n; ++j) {
        const float* vr = v + (j0 + j) * row;
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int i = 0; i < NV; ++i) o[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * i), o[i]);
      }
    }
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(a + 8 * i, o[i]);
    m[g] = mg;
    l[g] = lg;
  }
}
#endif

#ifdef PR_BF16_DOT
// The same for bfloat16 with D = 32 * NC, 16 keys at a time on AVX512-BF16; V rows
// are widened once per key for all G heads. The softmax reference m[g] moves only when
// a score exceeds it by more than RESCALE (then acc and the sums are rescaled): most
// chunks skip the horizontal max, the scalar exp and the rescale, whose serial chain
// cost more than the chunk's products. exp(s - m) <= e^RESCALE stays far from fp32's
// range. Row sums are kept as 16 lanes (`lv`, 16 floats per row), added up at the end.
constexpr float RESCALE = 8.f;

// The next block's K and V rows of the item's heads, prefetched in address order,
// `per_call` cache lines per call: spread over the current block's compute (see `decode`).
struct NextBlock {
  const char *k = nullptr, *v = nullptr;
  int64_t stride = 0, lines_per_row = 1, left = 0, line = 0, per_call = 0;
  bool l2 = false;
  // rows [0, rows) of `span` bytes `stride` bytes apart at k_rows / v_rows, over `calls` calls of fetch()
  void start(const void* k_rows, const void* v_rows, int64_t stride_bytes, int64_t span, int64_t rows,
             int64_t calls) {
    k = static_cast<const char*>(k_rows);
    v = static_cast<const char*>(v_rows);
    stride = stride_bytes;
    lines_per_row = (span + 63) / 64;
    left = rows * lines_per_row;
    line = 0;
    per_call = (left + std::max<int64_t>(calls, 1) - 1) / std::max<int64_t>(calls, 1);
    l2 = g_prefetch_l2.load(std::memory_order_relaxed) != 0;
  }
  inline void fetch() {
    for (int64_t n = std::min(left, per_call); n > 0; --n, --left) {
      if (l2) {
        __builtin_prefetch(k + 64 * line, 0, 2);
        __builtin_prefetch(v + 64 * line, 0, 2);
      } else {
        __builtin_prefetch(k + 64 * line);
        __builtin_prefetch(v + 64 * line);
      }
      if (++line == lines_per_row) {
        line = 0;
        k += stride;
        v += stride;
      }
    }
  }
};

// Heads whose PV accumulators stay in registers at once (16 vectors).
constexpr int pv_heads(int NC) { return NC <= 2 ? 4 : 2; }

// acc[g] = corr[g] * acc[g] + sum_j p[g][j] v[j] over the valid keys [a, b) of a 16-key
// chunk, for NG heads (accumulators in registers); each V row is widened once for all
// of them. Each key prefetches a few lines of the next block (`next`).
template <int NC, int NG>
inline void pv16(const uint16_t* v, int64_t row, int64_t a, int64_t b, const float (*p)[16],
                 const float* corr, float* acc, NextBlock* next) {
  constexpr int NV = 2 * NC;
  __m512 o[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) {
      o[g][i] = _mm512_loadu_ps(acc + g * 32 * NC + 16 * i);
      if (corr[g] != 1.f) o[g][i] = _mm512_mul_ps(o[g][i], _mm512_set1_ps(corr[g]));
    }
  for (int64_t j = a; j < b; ++j) {
    next->fetch();
    const uint16_t* vr = v + j * row;
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + 16 * i))), 16));
    for (int g = 0; g < NG; ++g) {
      const __m512 pj = _mm512_set1_ps(p[g][j]);
      for (int i = 0; i < NV; ++i) o[g][i] = _mm512_fmadd_ps(pj, vv[i], o[g][i]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * 32 * NC + 16 * i, o[g][i]);
}

template <int NC>
inline void decode_block_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t row, int64_t ja,
                              int64_t jb, int64_t G, float scale, float softcap, float* m, float* lv, float* acc,
                              NextBlock* next) {
  constexpr int D = 32 * NC;
  for (int64_t c0 = ja - ja % 16; c0 < jb; c0 += 16) {
    const int64_t a = std::max<int64_t>(ja - c0, 0), b = std::min<int64_t>(jb - c0, 16);
    const __mmask16 valid = __mmask16(((1u << b) - 1u) & ~((1u << a) - 1u));
    alignas(64) float p[16][16];  // [g][j]
    float corr[16];
    for (int64_t g = 0; g < G; ++g) {
      __m512 s = scores16<NC>(q + g * D, k + c0 * row, row, a, b, scale);
      if (softcap > 0.f) s = softcap16(s, softcap);
      corr[g] = 1.f;
      if (_mm512_mask_cmp_ps_mask(valid, s, _mm512_set1_ps(m[g] + RESCALE), _CMP_GT_OQ)) {
        const float mx = std::max(m[g], _mm512_mask_reduce_max_ps(valid, s));
        corr[g] = fast_exp(m[g] - mx);
        m[g] = mx;
        _mm512_storeu_ps(lv + 16 * g, _mm512_mul_ps(_mm512_loadu_ps(lv + 16 * g), _mm512_set1_ps(corr[g])));
      }
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m[g]))));
      _mm512_storeu_ps(lv + 16 * g, _mm512_add_ps(_mm512_loadu_ps(lv + 16 * g), e));
      _mm512_store_ps(p[g], e);
    }
    constexpr int NG = pv_heads(NC);
    for (int64_t g0 = 0; g0 < G; g0 += NG) {
      const uint16_t* vc = v + c0 * row;
      switch (std::min<int64_t>(NG, G - g0)) {
        case 1: pv16<NC, 1>(vc, row, a, b, p + g0, corr + g0, acc + g0 * D, next); break;
        case 2: pv16<NC, 2>(vc, row, a, b, p + g0, corr + g0, acc + g0 * D, next); break;
        case 3: pv16<NC, 3>(vc, row, a, b, p + g0, corr + g0, acc + g0 * D, next); break;
        default: pv16<NC, NG>(vc, row, a, b, p + g0, corr + g0, acc + g0 * D, next); break;
      }
    }
  }
}

#endif

template <typename T>
void decode_item(void* ctx, int64_t idx, int) {
  const DecodeCall<T>& c = *static_cast<const DecodeCall<T>*>(ctx);
  const DecodeItem& it = c.items[idx];
  const int64_t G = c.G, D = c.D, bs = c.bs, row = c.Hkv * D, nh = it.h1 - it.h0;
  const T* q = c.q + int64_t(c.qsl[it.r]) * c.q_ts + it.h0 * G * D;
  const int32_t* table = c.bt + it.r * c.bt_stride;
  float acc[DEC_MAX_GD], m[DEC_MAX_GD / 32], l[DEC_MAX_GD / 32];  // [head - h0][g]...
  std::fill(acc, acc + nh * G * D, 0.f);
  std::fill(m, m + nh * G, -std::numeric_limits<float>::infinity());
  std::fill(l, l + nh * G, 0.f);
#ifdef PR_BF16_DOT
  const bool bf16_dot = std::is_same<T, uint16_t>::value && (D == 64 || D == 128);
  alignas(64) float lv[DEC_MAX_GD / 32 * 16];  // the bfloat16 path's row sums, 16 lanes per row
  if (bf16_dot) std::fill(lv, lv + nh * G * 16, 0.f);
#else
  const bool bf16_dot = false;
#endif
  for (int64_t b = it.k0 / bs; b * bs < it.k1; ++b) {
    const int64_t off = (int64_t(table[b]) * bs) * row + it.h0 * D;
    const bool has_next = (b + 1) * bs < it.k1;
    const int64_t noff = has_next ? (int64_t(table[b + 1]) * bs) * row + it.h0 * D : 0;
    if (has_next && !bf16_dot) {  // the next block (elsewhere in memory): its K and V rows of these heads
      for (int64_t j = 0; j < bs; ++j)
        for (int64_t e = 0; e < nh * D * int64_t(sizeof(T)); e += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(c.kc + noff + j * row) + e);
          __builtin_prefetch(reinterpret_cast<const char*>(c.vc + noff + j * row) + e);
        }
    }
    const int64_t ja = std::max(it.k0 - b * bs, int64_t(0)), jb = std::min(it.k1 - b * bs, bs);
#ifdef PR_BF16_DOT
    NextBlock next;  // one call per (key, head, group of pv_heads query heads) of this block
    if (has_next && bf16_dot) {
      const int64_t groups = (G + pv_heads(D / 32) - 1) / pv_heads(D / 32);
      next.start(c.kc + noff, c.vc + noff, row * int64_t(sizeof(T)), nh * D * int64_t(sizeof(T)), bs,
                 nh * (jb - ja) * groups);
    }
#endif
    for (int64_t h = 0; h < nh; ++h) {
      const T* qh = q + h * G * D;
      const T* kb = c.kc + off + h * D;
      const T* vb = c.vc + off + h * D;
      float *mh = m + h * G, *lh = l + h * G, *ah = acc + h * G * D;
#ifdef PR_BF16_DOT
      if (bf16_dot) {
        const uint16_t* q16 = reinterpret_cast<const uint16_t*>(qh);
        const uint16_t* k16 = reinterpret_cast<const uint16_t*>(kb);
        const uint16_t* v16 = reinterpret_cast<const uint16_t*>(vb);
        float* lvh = lv + h * G * 16;
        if (D == 64) decode_block_bf16<2>(q16, k16, v16, row, ja, jb, G, c.scale, c.softcap, mh, lvh, ah, &next);
        else decode_block_bf16<4>(q16, k16, v16, row, ja, jb, G, c.scale, c.softcap, mh, lvh, ah, &next);
        continue;
      }
#endif
#ifdef PR_F32_AVX2
      if constexpr (std::is_same_v<T, float>) {
        if (D == 64 || D == 128) {
          if (D == 64) decode_block_f32<8>(qh, kb, vb, row, ja, jb, G, c.scale, c.softcap, mh, lh, ah);
          else decode_block_f32<16>(qh, kb, vb, row, ja, jb, G, c.scale, c.softcap, mh, lh, ah);
          continue;
        }
      }
#endif
      decode_block<T>(qh, kb, vb, row, ja, jb, G, D, c.scale, c.softcap, mh, lh, ah);
    }
  }
#ifdef PR_BF16_DOT
  if (bf16_dot)
    for (int64_t g = 0; g < nh * G; ++g) l[g] = _mm512_reduce_add_ps(_mm512_load_ps(lv + 16 * g));
#endif
  if (it.part < 0) {  // the whole context: normalise into out
    for (int64_t g = 0; g < nh * G; ++g) {
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
      T* dst = c.out + int64_t(c.qsl[it.r]) * c.o_ts + (it.h0 * G + g) * D;
      for (int64_t d = 0; d < D; ++d) st(dst + d, acc[g * D + d] * inv);
    }
    return;
  }
  float* p = c.part + it.part * G * (D + 2);  // split items hold one KV head
  for (int64_t g = 0; g < G; ++g) {
    std::copy(acc + g * D, acc + (g + 1) * D, p + g * (D + 2));
    p[g * (D + 2) + D] = m[g];
    p[g * (D + 2) + D + 1] = l[g];
  }
}

// Requests [r_begin, r_end) with one query each (seq_len 0: skipped). Returns
// false when the shapes do not fit the decode kernel (the caller uses `attend`).
template <typename T>
bool decode(const T* q, int64_t q_ts, const T* cache, int64_t NB, int64_t bs, int64_t Hkv, int64_t D,
            const int32_t* qsl, const int32_t* seq_lens, const int32_t* bt, int64_t bt_stride, T* out,
            int64_t o_ts, int64_t r_begin, int64_t r_end, int64_t Hq, float scale, int64_t window, float softcap,
            int threads) {
  const int64_t G = Hq / Hkv;
  if (G * D > DEC_MAX_GD || G > 16 || D > 512) return false;
  for (int64_t r = r_begin; r < r_end; ++r)
    if (int64_t(qsl[r + 1]) - qsl[r] > 1) return false;
  DecodeCall<T> c{q, cache, cache + NB * bs * Hkv * D, out, q_ts, o_ts, bs, Hkv, D, G, bt_stride,
                  qsl, seq_lens, bt, scale, softcap, {}, nullptr};
  int64_t reqs = 0;
  for (int64_t r = r_begin; r < r_end; ++r) reqs += (qsl[r + 1] > qsl[r] && seq_lens[r] > 0) ? 1 : 0;
  const bool whole = reqs >= 2 * threads && Hq * D <= DEC_MAX_GD && Hq <= DEC_MAX_GD / 32;  // all heads per item
  const int64_t pairs = reqs * Hkv;
  const int64_t want = pairs > 0 && pairs < 2 * threads ? (2 * threads + pairs - 1) / pairs : 1;
  std::vector<std::pair<int64_t, int64_t>> merges;  // (first part, number of parts) per split pair
  std::vector<int64_t> merge_rh;                    // r * Hkv + hk of each
  int64_t parts = 0;
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t L = seq_lens[r];
    if (qsl[r + 1] <= qsl[r] || L <= 0) continue;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, L - window) : 0;
    if (whole) {
      c.items.push_back({r, 0, Hkv, lo, L, -1});
      continue;
    }
    // splits of whole blocks, each at least DEC_MIN_SPLIT keys
    const int64_t nblk = (L + bs - 1) / bs - lo / bs;
    int64_t S = std::min(want, std::max<int64_t>(1, (L - lo) / DEC_MIN_SPLIT));
    S = std::max<int64_t>(1, std::min(S, nblk));
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      if (S == 1) {
        c.items.push_back({r, hk, hk + 1, lo, L, -1});
        continue;
      }
      merges.emplace_back(parts, S);
      merge_rh.push_back(r * Hkv + hk);
      const int64_t b0 = lo / bs;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t k0 = std::max(lo, (b0 + nblk * s / S) * bs), k1 = std::min(L, (b0 + nblk * (s + 1) / S) * bs);
        c.items.push_back({r, hk, hk + 1, k0, k1, parts++});
      }
    }
  }
  std::vector<float> part(size_t(parts * G * (D + 2)));
  c.part = part.data();
  pr::run_items(int64_t(c.items.size()), [&c](int64_t i) { decode_item<T>(&c, i, 0); });
  for (size_t i = 0; i < merges.size(); ++i) {  // out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
    const int64_t r = merge_rh[i] / Hkv, hk = merge_rh[i] % Hkv;
    for (int64_t g = 0; g < G; ++g) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < merges[i].second; ++s)
        M = std::max(M, part[((merges[i].first + s) * G + g) * (D + 2) + D]);
      float o[512] = {0.f}, lsum = 0.f;
      for (int64_t s = 0; s < merges[i].second; ++s) {
        const float* p = &part[((merges[i].first + s) * G + g) * (D + 2)];
        if (p[D + 1] <= 0.f) continue;
        const float w = fast_exp(p[D] - M);
        lsum += w * p[D + 1];
        for (int64_t d = 0; d < D; ++d) o[d] += w * p[d];
      }
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
      T* dst = out + int64_t(qsl[r]) * o_ts + (hk * G + g) * D;
      for (int64_t d = 0; d < D; ++d) st(dst + d, o[d] * inv);
    }
  }
  return true;
}

template <typename T>
void run(void* q, int64_t q_ts, void* k, int64_t k_ts, void* v, int64_t v_ts, void* cache,
         int64_t NB, int64_t bs, int64_t Hq, int64_t Hkv, int64_t D, const int64_t* slots,
         int64_t num_write, const int32_t* qsl, const int32_t* seq_lens, const int32_t* bt,
         int64_t bt_stride, void* out, int64_t o_ts, int64_t r_begin, int64_t r_end, float scale,
         int64_t window, float softcap) {
  if (num_write > 0)
    write_kv<T>(static_cast<const T*>(k), k_ts, static_cast<const T*>(v), v_ts,
                static_cast<T*>(cache), NB * bs, slots, num_write, Hkv, D);
  if (r_end > r_begin && !decode<T>(static_cast<const T*>(q), q_ts, static_cast<const T*>(cache), NB, bs, Hkv, D,
                                    qsl, seq_lens, bt, bt_stride, static_cast<T*>(out), o_ts, r_begin, r_end, Hq,
                                    scale, window, softcap, pr::pool_helpers() + 1))
    attend<T>(static_cast<const T*>(q), q_ts, static_cast<const T*>(cache), NB, bs, Hkv, D, qsl,
              seq_lens, bt, bt_stride, static_cast<T*>(out), o_ts, r_begin, r_end, Hq, scale,
              window, softcap);
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (q, k, v, cache and out share it). softcap > 0: scores
// (after the scale) become softcap * tanh(score / softcap) before the mask and softmax; 0: none.
int pr_paged_attention(int dtype, void* q, int64_t q_ts, void* k, int64_t k_ts, void* v,
                       int64_t v_ts, void* cache, int64_t NB, int64_t bs, int64_t Hq, int64_t Hkv,
                       int64_t D, const int64_t* slots, int64_t num_write, const int32_t* qsl,
                       const int32_t* seq_lens, const int32_t* bt, int64_t bt_stride, void* out,
                       int64_t o_ts, int64_t r_begin, int64_t r_end, float scale, int64_t window,
                       float softcap) {
  if (Hkv <= 0 || Hq % Hkv != 0) return 2;
  if (!(softcap >= 0.f)) return 3;  // negative or NaN
  if (dtype == 0)
    run<float>(q, q_ts, k, k_ts, v, v_ts, cache, NB, bs, Hq, Hkv, D, slots, num_write, qsl,
               seq_lens, bt, bt_stride, out, o_ts, r_begin, r_end, scale, window, softcap);
  else if (dtype == 1)
    run<uint16_t>(q, q_ts, k, k_ts, v, v_ts, cache, NB, bs, Hq, Hkv, D, slots, num_write, qsl,
                  seq_lens, bt, bt_stride, out, o_ts, r_begin, r_end, scale, window, softcap);
  else
    return 1;
  return 0;
}

int pr_abi_version() { return 1; }

// Where the bfloat16 decode prefetches the next block: 0 L1, 1 L2 (see g_prefetch_l2); returns the
// previous setting.
int pr_set_decode_prefetch(int l2) { return g_prefetch_l2.exchange(l2 ? 1 : 0); }

// out[j] = cap * tanh(s[j] / cap) for n floats by the kernels' soft cap: `simd` 1 the AVX-512
// softcap16 (returns 1 when this build has no AVX-512F code), 0 the portable loop. For tests.
int pr_softcap_scores(const float* s, float* out, int64_t n, float cap, int simd) {
  if (simd) {
#if defined(__AVX512F__) && !defined(PR_PORTABLE)
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(out + j, softcap16(_mm512_loadu_ps(s + j), cap));
    if (j < n) {
      const __mmask16 tail = __mmask16((1u << (n - j)) - 1u);
      _mm512_mask_storeu_ps(out + j, tail, softcap16(_mm512_maskz_loadu_ps(tail, s + j), cap));
    }
    return 0;
#else
    return 1;
#endif
  }
  std::copy(s, s + n, out);
  softcap_scores(out, n, cap);
  return 0;
}

// 1 when the float32 decode's AVX2 path (PR_F32_AVX2) is compiled in, else 0.
int pr_simd_f32() {
#ifdef PR_F32_AVX2
  return 1;
#else
  return 0;
#endif
}

// 1 when the AVX-512 BF16 paths (PR_BF16_DOT) are compiled in, else 0.
int pr_simd_bf16() {
#ifdef PR_BF16_DOT
  return 1;
#else
  return 0;
#endif
}
}
