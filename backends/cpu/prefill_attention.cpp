// Prefill attention for bfloat16 on AVX512_BF16: requests with many queries attend their
// whole context (this step's tokens, already written, plus any cached prefix) from the
// paged cache, as two small matmuls per tile on `vdpbf16ps` with an online softmax.
//
// torch's CPU flash attention runs these shapes (head_dim 64, a few hundred tokens) far
// below the core pair's peak (benchmarks/results/design-measurements.md); here each (request, KV head) first packs its keys and
// values once into VNNI pairs (shared by every query tile and the G query heads of that KV
// head), then a tile of 16 queries of one head computes
//   S = Q K^T      keys in lanes: a 32-key block is 2 vectors per dim pair, Q pairs broadcast
//   P = exp(S - m) online softmax in fp32; P rounded to bfloat16 for the second product
//   O += P V       dims in lanes: a key pair's values interleaved, P pairs broadcast
// Layout and masking as paged_attention.cpp (cache [2, NB, bs, Hkv, D]; query i of request r
// at position seq_lens[r] - n_q + i sees keys p <= pos and, with a window w > 0, p > pos - w; with a
// logit soft cap c > 0 each scaled score s becomes c * tanh(s / c) first, Gemma 2).
// Threads: OpenMP (prefill steps run where oneDNN's team is awake), dynamic over
// (request, KV head) packs, then over (request, head, query tile) items.
// Returns 0, or 1 when this build/shape is not supported (the caller uses SDPA).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(PR_PORTABLE)
#include <immintrin.h>
#define PR_PREFILL_BF16 1
#endif

#include "simd_exp.h"

#ifdef PR_PREFILL_BF16
namespace {

constexpr int64_t KB = 32;  // keys per block (2 vectors of scores)
constexpr int64_t QT = 16;  // queries per tile

struct Pack {  // one (request, KV head): keys [Lp / 32][D / 2][32], values [Lp / 2][D] (uint32 pairs)
  uint32_t* k;
  uint32_t* v;
};

// Keys and values of request r's KV head hk, positions [0, L), into VNNI pairs (zero past L).
void pack(const uint16_t* cache, int64_t NB, int64_t bs, int64_t Hkv, int64_t D, const int32_t* table, int64_t L,
          int64_t hk, Pack p) {
  const int64_t row = Hkv * D, P = D / 2, Lp = (L + KB - 1) / KB * KB;
  const uint16_t* kc = cache;
  const uint16_t* vc = cache + NB * bs * row;
  std::memset(p.k, 0, sizeof(uint32_t) * Lp * P);
  std::memset(p.v, 0, sizeof(uint32_t) * Lp * P);
  for (int64_t j = 0; j < L; ++j) {
    const int64_t slot = int64_t(table[j / bs]) * bs + j % bs;
    const uint16_t* kr = kc + slot * row + hk * D;
    const uint16_t* vr = vc + slot * row + hk * D;
    uint32_t* kd = p.k + (j / KB) * P * KB + j % KB;
    for (int64_t i = 0; i < P; ++i) std::memcpy(kd + i * KB, kr + 2 * i, 4);
    uint16_t* vd = reinterpret_cast<uint16_t*>(p.v + (j / 2) * D) + (j & 1);
    for (int64_t d = 0; d < D; ++d) vd[2 * d] = vr[d];
  }
}

inline __m512bh bcast_pair(const uint16_t* x) {
  uint32_t v;
  std::memcpy(&v, x, 4);
  return (__m512bh)_mm512_set1_epi32(int32_t(v));
}

// The softmax reference of a row moves only when a score exceeds it by more than RESCALE2 (base-2
// units, e^8 as in the decode kernel): most blocks skip the horizontal max, the rescale of the
// row's sums and output, and the serial chain between them.
constexpr float RESCALE2 = 8.f * 1.4426950408889634f;

// O += P V for rows [i0, i0 + NR) of a tile over key pairs [j0, j1) of a block: each V vector is
// loaded once for the NR rows, whose accumulators (NR * ND vectors) stay in registers.
template <int ND, int NR>
inline void pv_rows(const uint32_t* vb, int64_t j0, int64_t j1, const uint32_t (*pp)[16], const float* corr,
                    float (*acc)[16 * ND]) {
  __m512 o[NR][ND];
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < ND; ++d) {
      o[r][d] = _mm512_load_ps(acc[r] + 16 * d);
      if (corr[r] != 1.f) o[r][d] = _mm512_mul_ps(o[r][d], _mm512_set1_ps(corr[r]));
    }
  for (int64_t j = j0; j < j1; ++j) {
    __m512bh v[ND];
    for (int d = 0; d < ND; ++d) v[d] = (__m512bh)_mm512_loadu_si512(vb + j * 16 * ND + 16 * d);
    for (int r = 0; r < NR; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(int32_t(pp[r][j]));
      for (int d = 0; d < ND; ++d) o[r][d] = _mm512_dpbf16_ps(o[r][d], x, v[d]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int d = 0; d < ND; ++d) _mm512_store_ps(acc[r] + 16 * d, o[r][d]);
}

// One tile: queries [t0, t0 + nt) of request (q0, nq, L), head h (KV head via pack p). Per 32-key
// block: S = Q K^T for the tile's rows, then P = 2^(S c - m) per row (c = scale log2 e; lanes outside
// the row's visible keys masked), then O += P V in row groups (each V vector loaded once a group).
template <int ND>  // D = 16 * ND
void tile(const uint16_t* q, int64_t q_ts, int64_t h, int64_t q0, int64_t nq, int64_t L, int64_t t0, int64_t nt,
          Pack p, uint16_t* out, int64_t o_ts, float scale, int64_t window, float softcap) {
  constexpr int64_t D = 16 * ND, P = D / 2;
  constexpr int NR = ND <= 4 ? 4 : 2;  // rows per P V group: NR * ND accumulators in registers
  const float NEG = -std::numeric_limits<float>::infinity();
  alignas(64) float acc[QT][D];
  alignas(64) float s[QT][KB];
  alignas(64) float lsum[QT][16];  // per row: the sums of P, 16 lanes, added up at the end
  alignas(64) uint32_t pp[QT][16];  // per row: P as bfloat16 pairs, lane j = keys (2j, 2j + 1)
  float m[QT], corr[QT];
  for (int64_t i = 0; i < QT; ++i) {
    m[i] = NEG;
    std::fill(acc[i], acc[i] + D, 0.f);
    std::fill(lsum[i], lsum[i] + 16, 0.f);
    std::fill(pp[i], pp[i] + 16, 0u);
    corr[i] = 1.f;
  }
  const int64_t pos0 = L - nq + t0, pos1 = pos0 + nt - 1;  // positions of the first and last query
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  // 2^(x c) = e^(x * scale); with a soft cap the scores are capped (scale included) first
  const __m512 c = _mm512_set1_ps((softcap > 0.f ? 1.f : scale) * 1.4426950408889634f);
  for (int64_t b = lo / KB; b * KB <= pos1; ++b) {
    const uint32_t* kb = p.k + b * P * KB;
    // S = Q K^T for the block, 4 query rows at a time
    for (int64_t i0 = 0; i0 < nt; i0 += 4) {
      const int64_t ni = std::min<int64_t>(4, nt - i0);
      __m512 s0[4], s1[4];
      for (int r = 0; r < 4; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
      const uint16_t* qr[4];
      for (int r = 0; r < 4; ++r) qr[r] = q + (q0 + t0 + i0 + std::min<int64_t>(r, ni - 1)) * q_ts + h * D;
      for (int64_t i = 0; i < P; ++i) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + i * KB), k1 = (__m512bh)_mm512_loadu_si512(kb + i * KB + 16);
        for (int r = 0; r < 4; ++r) {
          const __m512bh x = bcast_pair(qr[r] + 2 * i);
          s0[r] = _mm512_dpbf16_ps(s0[r], x, k0);
          s1[r] = _mm512_dpbf16_ps(s1[r], x, k1);
        }
      }
      for (int64_t r = 0; r < ni; ++r) {
        _mm512_store_ps(s[i0 + r], s0[r]);
        _mm512_store_ps(s[i0 + r] + 16, s1[r]);
      }
    }
    // P per row: keys [first, pos] are visible; the block's lanes outside them are masked
    const int64_t base = b * KB;
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t pos = pos0 + i, first = window > 0 ? pos - window + 1 : 0;
      corr[i] = 1.f;
      if (pos < base || first > base + KB - 1) {  // nothing visible in this block
        std::fill(pp[i], pp[i] + 16, 0u);
        continue;
      }
      __mmask16 ok[2];
      __m512 t[2];
      for (int k = 0; k < 2; ++k) {
        const int64_t a = std::max<int64_t>(first - base - 16 * k, 0), z = std::min<int64_t>(pos - base - 16 * k, 15);
        ok[k] = z < a ? __mmask16(0) : __mmask16(((2u << z) - 1u) & ~((1u << a) - 1u));
        t[k] = _mm512_load_ps(s[i] + 16 * k);
        if (softcap > 0.f) t[k] = softcap16(_mm512_mul_ps(t[k], _mm512_set1_ps(scale)), softcap);
        t[k] = _mm512_mul_ps(t[k], c);
      }
      const __m512 lim = _mm512_set1_ps(m[i] + RESCALE2);
      if (_mm512_mask_cmp_ps_mask(ok[0], t[0], lim, _CMP_GT_OQ) | _mm512_mask_cmp_ps_mask(ok[1], t[1], lim, _CMP_GT_OQ)) {
        float mx = m[i];
        for (int k = 0; k < 2; ++k)
          if (ok[k]) mx = std::max(mx, _mm512_mask_reduce_max_ps(ok[k], t[k]));
        corr[i] = m[i] == NEG ? 0.f : _mm512_cvtss_f32(exp2_16(_mm512_set1_ps(m[i] - mx)));
        m[i] = mx;
        _mm512_store_ps(lsum[i], _mm512_mul_ps(_mm512_load_ps(lsum[i]), _mm512_set1_ps(corr[i])));
      }
      const __m512 mi = _mm512_set1_ps(m[i]);
      __m512 e[2];
      for (int k = 0; k < 2; ++k) e[k] = _mm512_maskz_mov_ps(ok[k], exp2_16(_mm512_sub_ps(t[k], mi)));
      _mm512_store_ps(lsum[i], _mm512_add_ps(_mm512_load_ps(lsum[i]), _mm512_add_ps(e[0], e[1])));
      _mm512_store_si512(pp[i], (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    }
    // O += P V over the key pairs any row sees
    const int64_t j0 = std::max<int64_t>(0, lo - base) / 2, j1 = std::min<int64_t>(KB, pos1 - base + 1 + 1) / 2;
    const uint32_t* vb = p.v + b * (KB / 2) * D;
    int64_t i0 = 0;
    for (; i0 + NR <= nt; i0 += NR) pv_rows<ND, NR>(vb, j0, j1, pp + i0, corr + i0, acc + i0);
    for (; i0 < nt; ++i0) pv_rows<ND, 1>(vb, j0, j1, pp + i0, corr + i0, acc + i0);
  }
  for (int64_t i = 0; i < nt; ++i) {
    const float l = _mm512_reduce_add_ps(_mm512_load_ps(lsum[i]));
    const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
    uint16_t* dst = out + (q0 + t0 + i) * o_ts + h * D;
    for (int d = 0; d < ND; ++d)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * d),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[i] + 16 * d), inv)));
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PR_PREFILL_AMX 1
}  // namespace
#include "amx_tiles.h"
namespace {
// The same tile on AMX, two-pass instead of online: S = Q K^T for every key block the tile sees
// (AMX, into a row-major float buffer), an exact softmax per row (one max and one sum over the whole
// row, P rounded to bfloat16 as above), then O = P V (AMX), normalised once. The softmax touches only
// the 16-key chunks holding the row's visible keys, masks only the two at its ends, and folds the
// scale into one FMA before `exp2_16` (-15% prefill attention time in W1, Xeon AMX). The packs' layouts are
// already tile rows: a K tile (32 dims x 16 keys) is 16 dim pairs of the block, stride 32 pairs; a V
// tile (32 keys x 16 dims) is 16 key pairs, stride D. Tiles: 0-3 sums, 2/4/5 or 4-7 operands.
void tile_amx(const uint16_t* q, int64_t q_ts, int64_t h, int64_t q0, int64_t nq, int64_t L, int64_t t0, int64_t nt,
              int64_t D, Pack p, uint16_t* out, int64_t o_ts, float scale, int64_t window, float softcap) {
  const int64_t P = D / 2;
  const int64_t pos0 = L - nq + t0, pos1 = pos0 + nt - 1;
  const int64_t b0 = (window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0) / KB, b1 = pos1 / KB + 1;
  const int64_t W = (b1 - b0) * KB;  // keys [b0 * KB, b1 * KB) in the buffers
  thread_local std::vector<float> sbuf;
  thread_local std::vector<uint16_t> pbuf, qbuf;
  sbuf.resize(size_t(QT * W));
  pbuf.resize(size_t(QT * W));
  qbuf.assign(size_t(QT * D), 0);  // the tile's queries, padded with zero rows to 16
  for (int64_t i = 0; i < nt; ++i) std::memcpy(&qbuf[i * D], q + (q0 + t0 + i) * q_ts + h * D, size_t(D) * 2);
  pr::configure_tiles_16x64();
  for (int64_t b = b0; b < b1; ++b) {  // S, 32 keys (two C tiles) per block
    const uint32_t* kb = p.k + b * P * KB;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t db = 0; db < D / 32; ++db) {
      _tile_loadd(2, &qbuf[db * 32], D * 2);
      _tile_loadd(4, kb + db * 16 * KB, KB * 4);
      _tile_loadd(5, kb + db * 16 * KB + 16, KB * 4);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 2, 5);
    }
    _tile_stored(0, &sbuf[(b - b0) * KB], W * 4);
    _tile_stored(1, &sbuf[(b - b0) * KB + 16], W * 4);
  }
  float l[QT];
  // exp(x * scale) = 2^(x * c); with a soft cap the row's S is capped in place first (scale included)
  const __m512 c = _mm512_set1_ps((softcap > 0.f ? 1.f : scale) * 1.4426950408889634f);
  for (int64_t i = 0; i < QT; ++i) {  // P = exp(S * scale - max) on the keys row i sees, else 0
    uint16_t* pr = &pbuf[i * W];
    if (i >= nt) {
      std::memset(pr, 0, size_t(W) * 2);
      continue;
    }
    float* sr = &sbuf[i * W];
    const int64_t pos = pos0 + i, first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    const int64_t jlo = first - b0 * KB, jhi = pos - b0 * KB;  // the keys row i sees, in buffer columns
    const int64_t c0 = jlo / 16 * 16, c1 = (jhi / 16 + 1) * 16;  // the 16-key chunks holding them
    std::memset(pr, 0, size_t(c0) * 2);
    std::memset(pr + c1, 0, size_t(W - c1) * 2);
    auto valid = [&](int64_t j) -> __mmask16 {  // lanes of chunk j inside [jlo, jhi]
      uint32_t bits = 0xFFFF;
      if (j < jlo) bits &= 0xFFFFu << (jlo - j);
      if (jhi - j < 15) bits &= (1u << (jhi - j + 1)) - 1;
      return __mmask16(bits);
    };
    if (softcap > 0.f)  // S <- softcap * tanh(S * scale / softcap) on the chunks the row sees
      for (int64_t j = c0; j < c1; j += 16)
        _mm512_storeu_ps(sr + j, softcap16(_mm512_mul_ps(_mm512_loadu_ps(sr + j), _mm512_set1_ps(scale)), softcap));
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = c0; j < c1; j += 16) {  // scale > 0: the max of S is that of S * scale
      const __m512 s = _mm512_loadu_ps(sr + j);
      mx = (j < jlo || j + 15 > jhi) ? _mm512_mask_max_ps(mx, valid(j), mx, s) : _mm512_max_ps(mx, s);
    }
    const __m512 mc = _mm512_set1_ps(-_mm512_reduce_max_ps(mx) * _mm512_cvtss_f32(c));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = c0; j < c1; j += 16) {
      __m512 e = exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(sr + j), c, mc));
      if (j < jlo || j + 15 > jhi) e = _mm512_maskz_mov_ps(valid(j), e);
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    l[i] = _mm512_reduce_add_ps(sum);
  }
  alignas(64) float o[4][16][16];
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // O = P V, 64 dims (four C tiles) at a time
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = b0; b < b1; ++b) {
      const uint32_t* vb = p.v + b * (KB / 2) * D + d0;
      _tile_loadd(4, &pbuf[(b - b0) * KB], W * 2);
      _tile_loadd(5, vb, D * 4);
      _tile_loadd(6, vb + 16, D * 4);
      _tile_loadd(7, vb + 32, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, vb + 48, D * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, o[0], 64);
    _tile_stored(1, o[1], 64);
    _tile_stored(2, o[2], 64);
    _tile_stored(3, o[3], 64);
    for (int64_t i = 0; i < nt; ++i) {
      const __m512 inv = _mm512_set1_ps(l[i] > 0.f ? 1.f / l[i] : 0.f);
      uint16_t* dst = out + (q0 + t0 + i) * o_ts + h * D + d0;
      for (int c = 0; c < 4; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o[c][i]), inv)));
    }
  }
  _tile_release();
}
#endif

}  // namespace
#endif

extern "C" {

// 1 when the AMX variant of pr_prefill_attention_bf16 is compiled in, else 0.
int pr_prefill_attention_amx() {
#ifdef PR_PREFILL_AMX
  return 1;
#else
  return 0;
#endif
}

// Attend requests [r_begin, r_end) (bfloat16, D 64 or 128); arguments as pr_paged_attention's
// (the step's keys and values already in the cache, `softcap` 0: none); `amx`: the AMX tiles instead
// of vdpbf16ps. 0, or 1 when unsupported here.
int pr_prefill_attention_bf16(const uint16_t* q, int64_t q_ts, const uint16_t* cache, int64_t NB, int64_t bs,
                              int64_t Hq, int64_t Hkv, int64_t D, const int32_t* qsl, const int32_t* seq_lens,
                              const int32_t* bt, int64_t bt_stride, uint16_t* out, int64_t o_ts, int64_t r_begin,
                              int64_t r_end, float scale, int64_t window, float softcap, int64_t amx) {
#ifdef PR_PREFILL_BF16
  if ((D != 64 && D != 128) || Hkv <= 0 || Hq % Hkv || !(softcap >= 0.f)) return 1;
#ifndef PR_PREFILL_AMX
  if (amx) return 1;
#endif
  const int64_t G = Hq / Hkv;
  std::vector<int64_t> offset(r_end - r_begin + 1, 0);  // pack words before request r's
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t L = qsl[r + 1] > qsl[r] ? seq_lens[r] : 0;
    offset[r - r_begin + 1] = offset[r - r_begin] + Hkv * 2 * ((L + KB - 1) / KB * KB) * (D / 2);
  }
  std::vector<uint32_t> buf(offset.back());
  auto pack_of = [&](int64_t r, int64_t hk) {
    const int64_t Lp = (int64_t(seq_lens[r]) + KB - 1) / KB * KB, words = Lp * (D / 2);
    uint32_t* base = buf.data() + offset[r - r_begin] + hk * 2 * words;
    return Pack{base, base + words};
  };
  std::vector<std::pair<int64_t, int64_t>> packs;        // (request, KV head)
  std::vector<std::pair<int64_t, int64_t>> items;        // (request * Hq + head, first query)
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t nq = int64_t(qsl[r + 1]) - qsl[r];
    if (nq <= 0 || seq_lens[r] <= 0) continue;
    for (int64_t hk = 0; hk < Hkv; ++hk) packs.emplace_back(r, hk);
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t t0 = 0; t0 < nq; t0 += QT) items.emplace_back(r * Hq + h, t0);
  }
  const int64_t n_packs = int64_t(packs.size()), n_items = int64_t(items.size());
#pragma omp parallel if (n_items > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_packs; ++i) {
      const int64_t r = packs[i].first, hk = packs[i].second;
      pack(cache, NB, bs, Hkv, D, bt + r * bt_stride, seq_lens[r], hk, pack_of(r, hk));
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) {
      const int64_t r = items[i].first / Hq, h = items[i].first % Hq, t0 = items[i].second;
      const int64_t nq = int64_t(qsl[r + 1]) - qsl[r], nt = std::min<int64_t>(QT, nq - t0);
      const Pack p = pack_of(r, h / G);
#ifdef PR_PREFILL_AMX
      if (amx) {
        tile_amx(q, q_ts, h, qsl[r], nq, seq_lens[r], t0, nt, D, p, out, o_ts, scale, window, softcap);
        continue;
      }
#endif
      if (D == 64)
        tile<4>(q, q_ts, h, qsl[r], nq, seq_lens[r], t0, nt, p, out, o_ts, scale, window, softcap);
      else
        tile<8>(q, q_ts, h, qsl[r], nq, seq_lens[r], t0, nt, p, out, o_ts, scale, window, softcap);
    }
  }
  return 0;
#else
  (void)q; (void)q_ts; (void)cache; (void)NB; (void)bs; (void)Hq; (void)Hkv; (void)D; (void)qsl; (void)seq_lens;
  (void)bt; (void)bt_stride; (void)out; (void)o_ts; (void)r_begin; (void)r_end; (void)scale; (void)window;
  (void)softcap; (void)amx;
  return 1;
#endif
}
}
