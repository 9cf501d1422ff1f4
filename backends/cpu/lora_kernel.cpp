// The "lora" role's CPU kernel: one call per LoRA linear (lora_module.py), vLLM's punica idea.
//
// pr_lora(x [T, in], y [T, out], token_lora [T], lora_a [L, S*R, in], lora_b [L, out, S*R]) adds
// each token's adapter update to y in place: y[t] += (x[t] @ lora_a[l].T) @ lora_b[l].T, l =
// token_lora[t]; a token whose slot is outside [0, L) (-1: no adapter) is left as it is.
//
// Tokens are grouped by slot (a counting sort of token_lora), then per slot with tokens:
// shrink s = x_g @ A^T (all S*R rows of the slot's A: a zero-padded row costs a dot, no branch)
// and expand y_g += s @ B^T, where output slice i's rows read only the R columns i*R:(i+1)*R of
// B and s (the block diagonal: the zero blocks are skipped). Products and sums in float32; a
// bfloat16 y is widened, added to and rounded once (as the reference add_lora does).
//
// Weights are read in place (the adapters are written into the slots between steps), bfloat16
// widened to float32 by a 16-bit shift (AVX-512F only). The shrink runs dot blocks of MR tokens x
// NR rows of A (widen_dot.h); float32 x rows are read in place, bfloat16 ones widened once. The
// expand has K = R (16 at vLLM's default), too short for one horizontal sum per output: it goes
// over blocks of V = 16 output columns instead, the block's 16 x R piece of B transposed once in
// registers (bfloat16: an 8 x 8 dword transpose per half, a dword holding two r), then each token
// of the slot adds sum_r s[t, r] * Bt[r] (broadcast FMAs, four tokens at a time) to its V columns
// of y. With many slots the kernel streams the slots' weights from memory (about 2/3 of it B,
// whose block-diagonal zeros share cache lines with the slice's columns): B rows are prefetched
// PF_ROWS ahead. Work items are (slot, SHRINK_ROWS rows of A) for the shrink and (slot, TILE_N
// output columns) for the expand, shared out on the pool (thread_pool.h) in decode-sized steps
// or on the OpenMP team in prefill: two dispatches per call. No allocation: the caller passes
// `scratch` of pr_lora_scratch_bytes(chunk, ...) bytes and the tokens go in chunks of `chunk`.
// The portable build (PR_PORTABLE, CPUs without AVX-512) runs the same items with plain loops.
//
// pr_lora_embed(ids [T], y [T, H], token_lora [T], lora_a [L, V, R], lora_b [L, H, R]) is the
// "lora_embedding" role's: y[t] += lora_a[l, ids[t]] @ lora_b[l].T. Work items are MR consecutive
// tokens (a request's tokens are consecutive, so mostly one slot); a run of tokens of one slot
// shares each block of NR rows of B (widen_dot.h's dot blocks, K = R).

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && !defined(PR_PORTABLE)
#include <immintrin.h>
#define PR_LORA_AVX512 1
#endif

#include "thread_pool.h"
#include "widen_dot.h"

namespace {
constexpr int64_t SHRINK_ROWS = 8;   // shrink item: 8 rows of a slot's A (two dot blocks of NR)
constexpr int64_t TILE_N = 128;      // expand item: 128 output columns of a slot (blocks of V)
constexpr int64_t PF_ROWS = 64;      // B rows prefetched ahead in the expand
constexpr int V = 16;                // output columns per transposed block of B (one vector)
constexpr int64_t MAX_RANK = 512;    // vLLM's largest max_lora_rank (the expand's stack buffer)
constexpr int64_t INLINE_WIDEN = 1 << 14;   // x elements widened on the caller, no pool dispatch

using namespace pr_widen;

using pr::run_items;

// The scratch of one chunk of up to C tokens, 64-byte aligned pieces.
struct Scratch {
  float* xf;          // [C, in] the grouped tokens' x in float32, by sorted position (bfloat16 x only)
  float* s;           // [C, S*R] their shrink results, by sorted position
  int32_t* tok;       // [C] sorted position -> token
  int64_t* start;     // [L + 1] the slots' first sorted positions
  int32_t* active;    // [L] slots that received tokens
};

inline int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

int64_t layout(int64_t C, int64_t K, int64_t L, int64_t SR, char* base, Scratch* s) {
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    char* p = base ? base + off : nullptr;
    off += align64(bytes);
    return p;
  };
  char* xf = take(C * K * 4);
  char* sh = take(C * SR * 4);
  char* tok = take(C * 4);
  char* start = take((L + 1) * 8);
  char* active = take(L * 4);
  if (s) *s = {reinterpret_cast<float*>(xf), reinterpret_cast<float*>(sh), reinterpret_cast<int32_t*>(tok),
               reinterpret_cast<int64_t*>(start), reinterpret_cast<int32_t*>(active)};
  return off + 64;   // + slack to align the base
}

struct Args {
  int dtype;   // 0 float32, 1 bfloat16 (x, y, lora_a, lora_b)
  const void* x;
  int64_t x_ts;
  void* y;
  int64_t y_ts;
  const int32_t* token_lora;
  const void* a;
  const void* b;
  const int64_t* bounds;   // [S + 1] output slice boundaries: 0, ..., out
  int64_t K, N, L, S, R;
};

// Group tokens [t0, t0 + C) by slot; returns how many have one.
int64_t group(const Args& a, int64_t t0, int64_t C, const Scratch& s) {
  const int64_t L = a.L;
  for (int64_t l = 0; l <= L; ++l) s.start[l] = 0;
  for (int64_t t = 0; t < C; ++t) {
    const int32_t l = a.token_lora[t0 + t];
    if (l >= 0 && l < L) ++s.start[l + 1];
  }
  for (int64_t l = 0; l < L; ++l) s.start[l + 1] += s.start[l];
  int64_t fill[256 + 1];   // L <= 256 (checked by pr_lora)
  for (int64_t l = 0; l < L; ++l) fill[l] = s.start[l];
  for (int64_t t = 0; t < C; ++t) {
    const int32_t l = a.token_lora[t0 + t];
    if (l >= 0 && l < L) s.tok[fill[l]++] = int32_t(t0 + t);
  }
  return s.start[L];
}

// dst[k] = float32(src[k]), k < K.
inline void widen_row(const uint16_t* src, float* dst, int64_t K) {
  int64_t k = 0;
#ifdef PR_LORA_AVX512
  for (; k + V <= K; k += V) _mm512_storeu_ps(dst + k, load16(src + k));
#endif
  for (; k < K; ++k) dst[k] = bf16_to_f32(src[k]);
}

// y[q] += acc[q] for q < nc (y a row of float32 or bfloat16; bfloat16 rounded once).
inline void add_row(float* y, int nc, const float* acc) {
  for (int q = 0; q < nc; ++q) y[q] += acc[q];
}
inline void add_row(uint16_t* y, int nc, const float* acc) {
  for (int q = 0; q < nc; ++q) y[q] = f32_to_bf16(bf16_to_f32(y[q]) + acc[q]);
}

#ifdef PR_LORA_AVX512
// y[0:V] += acc (one full block of V columns).
inline void add_vec(float* y, __m512 acc) { _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), acc)); }
inline void add_vec(uint16_t* y, __m512 acc) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), to_bf16(_mm512_add_ps(load16(y), acc)));
}

// bt[r][q] = b[q * ld + r0 + r] for r, q < 16 (float32): 16 rows of 16 values transposed in
// registers (unpack, shuffle within 128-bit lanes, then two lane shuffles).
inline void transpose16(const float* b, int64_t ld, __m512 bt[V]) {
  __m512 m[V], t[V];
  for (int q = 0; q < V; ++q) m[q] = _mm512_loadu_ps(b + q * ld);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(m[2 * i], m[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(m[2 * i], m[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {   // m[4i + j], lane L: rows 4i..4i+3 at column 4L + j
    m[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    m[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    m[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    m[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {   // column 4L + j = lanes L of m[j], m[4 + j], m[8 + j], m[12 + j]
    const __m512 u0 = _mm512_shuffle_f32x4(m[j], m[4 + j], 0x88), u1 = _mm512_shuffle_f32x4(m[j], m[4 + j], 0xDD);
    const __m512 u2 = _mm512_shuffle_f32x4(m[8 + j], m[12 + j], 0x88);
    const __m512 u3 = _mm512_shuffle_f32x4(m[8 + j], m[12 + j], 0xDD);
    bt[j] = _mm512_shuffle_f32x4(u0, u2, 0x88);
    bt[4 + j] = _mm512_shuffle_f32x4(u1, u3, 0x88);
    bt[8 + j] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
    bt[12 + j] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
  }
}

// The same for bfloat16, widened: a row's 16 values are 8 dwords (pairs r = 2p, 2p + 1), so the
// 16 x 8 dword transpose runs on 8 registers (rows i and i + 8 in each), an 8 x 8 transpose per
// 256-bit half; then pair p's dwords give r = 2p (low halves, shifted up) and 2p + 1 (high halves).
inline void transpose16(const uint16_t* b, int64_t ld, __m512 bt[V]) {
  __m512 m[8], t[8];
  for (int i = 0; i < 8; ++i) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i * ld));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (i + 8) * ld));
    m[i] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
  }
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(m[2 * i], m[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(m[2 * i], m[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {   // m[4i + j], lane L: rows 4i..4i+3 (+8 in lanes 2, 3) at pair 4(L & 1) + j
    m[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    m[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    m[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    m[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  const __m512i lo_pairs = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi_pairs = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512i high = _mm512_set1_epi32(int32_t(0xffff0000u));
  for (int j = 0; j < 4; ++j) {   // pair j: lanes 0, 2 of m[j] with lanes 0, 2 of m[4 + j]; pair 4 + j: lanes 1, 3
    const __m512i p0 = _mm512_castps_si512(_mm512_permutex2var_ps(m[j], lo_pairs, m[4 + j]));
    const __m512i p1 = _mm512_castps_si512(_mm512_permutex2var_ps(m[j], hi_pairs, m[4 + j]));
    bt[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));
    bt[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(p0, high));
    bt[8 + 2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16));
    bt[8 + 2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(p1, high));
  }
}

// Rank 16, a full block: y[tok, c:c+V] += s[p, off:off+16] @ bt for the slot's tokens [p0, p1),
// bt (16 x V, the block's B transposed) in registers; two FMA chains per token (even, odd r).
template <class W>
void expand16(const W* b, int64_t ld, const float* s, int64_t ss, W* const* rows, int64_t n) {
  __m512 bt[V];
  transpose16(b, ld, bt);
  int64_t p = 0;
  for (; p + 4 <= n; p += 4) {
    __m512 acc[4][2];
    for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < V; r += 2)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        acc[j][0] = _mm512_fmadd_ps(_mm512_set1_ps(s[(p + j) * ss + r]), bt[r], acc[j][0]);
        acc[j][1] = _mm512_fmadd_ps(_mm512_set1_ps(s[(p + j) * ss + r + 1]), bt[r + 1], acc[j][1]);
      }
    for (int j = 0; j < 4; ++j) add_vec(rows[p + j], _mm512_add_ps(acc[j][0], acc[j][1]));
  }
  for (; p < n; ++p) {
    __m512 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int r = 0; r < V; r += 4)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(s[p * ss + r + j]), bt[r + j], acc[j]);
    add_vec(rows[p], _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  }
}
#endif

// Any rank, any block width nc <= V: bt[r * V + q] = b[q * ld + r] (float32; zeros for q >= nc),
// then y[tok, c:c+nc] += s[p, off:off+R] @ bt for the slot's tokens [0, n) (plain loops over the
// V columns, which the compiler vectorises).
template <class W>
void expand_any(const W* b, int64_t ld, int nc, int64_t R, const float* s, int64_t ss, W* const* rows, int64_t n) {
  alignas(64) float bt[MAX_RANK * V];
  int64_t r0 = 0;
#ifdef PR_LORA_AVX512
  if (nc == V)
    for (; r0 + V <= R; r0 += V) {
      __m512 t[V];
      transpose16(b + r0, ld, t);
      for (int r = 0; r < V; ++r) _mm512_store_ps(bt + (r0 + r) * V, t[r]);
    }
#endif
  for (int64_t r = r0; r < R; ++r)
    for (int q = 0; q < V; ++q) bt[r * V + q] = q < nc ? load1(b + q * ld, r) : 0.0f;
  for (int64_t p = 0; p < n; ++p) {
    alignas(64) float acc[V] = {};
    for (int64_t r = 0; r < R; ++r)
      for (int q = 0; q < V; ++q) acc[q] += s[p * ss + r] * bt[r * V + q];
    add_row(rows[p], nc, acc);
  }
}

template <class W>
void apply(const Args& a, int64_t n, const Scratch& s) {
  const int64_t K = a.K, N = a.N, L = a.L, R = a.R, SR = a.S * a.R;
  // x rows of the grouped tokens: read in place (float32) or widened into xf (bfloat16)
  const bool widen = a.dtype != 0;
  if (widen) {
    auto rows = [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        widen_row(static_cast<const uint16_t*>(a.x) + s.tok[p] * a.x_ts, s.xf + p * K, K);
    };
    if (n * K <= INLINE_WIDEN)
      rows(0, n);
    else
      run_items((n + 15) / 16, [&](int64_t i) { rows(16 * i, std::min(n, 16 * i + 16)); });
  }
  auto xrow = [&](int64_t p) {
    return widen ? s.xf + p * K : static_cast<const float*>(a.x) + s.tok[p] * a.x_ts;
  };
  int64_t na = 0;
  for (int64_t l = 0; l < L; ++l)
    if (s.start[l + 1] > s.start[l]) s.active[na++] = int32_t(l);
  const W* wa = static_cast<const W*>(a.a);
  const W* wb = static_cast<const W*>(a.b);
  // shrink: items (active slot, SHRINK_ROWS rows of its A) in dot blocks of MR tokens x NR rows
  const int64_t ta = (SR + SHRINK_ROWS - 1) / SHRINK_ROWS;
  run_items(na * ta, [&](int64_t item) {
    const int64_t l = s.active[item / ta], j0 = (item % ta) * SHRINK_ROWS;
    for (int64_t j = j0; j < std::min(SR, j0 + SHRINK_ROWS); j += NR) {
      const int nr = int(std::min<int64_t>(NR, SR - j));
      const W* wr[NR];
      for (int q = 0; q < nr; ++q) wr[q] = wa + (l * SR + j + q) * K;
      for (int64_t r = s.start[l]; r < s.start[l + 1]; r += MR) {
        const int mr = int(std::min<int64_t>(MR, s.start[l + 1] - r));
        const float* xr[MR];
        for (int m = 0; m < mr; ++m) xr[m] = xrow(r + m);
        float res[MR][NR];
        dot<W>(mr, nr, xr, wr, K, res);
        for (int m = 0; m < mr; ++m)
          for (int q = 0; q < nr; ++q) s.s[(r + m) * SR + j + q] = res[m][q];
      }
    }
  });
  // expand: items (active slot, TILE_N output columns) in blocks of V columns within one output
  // slice: the block's R columns of B transposed once, then every token of the slot
  const int64_t tn = (N + TILE_N - 1) / TILE_N;
  run_items(na * tn, [&](int64_t item) {
    const int64_t l = s.active[item / tn], c0 = (item % tn) * TILE_N, c1 = std::min(N, c0 + TILE_N);
    const int64_t p0 = s.start[l], n = s.start[l + 1] - p0;
    int64_t slice = 0;
    for (int64_t c = c0; c < std::min(N, c0 + PF_ROWS); ++c) {   // this item's first rows of B
      while (a.bounds[slice + 1] <= c) ++slice;
      __builtin_prefetch(wb + (l * N + c) * SR + slice * R);
    }
    slice = 0;
    for (int64_t c = c0; c < c1;) {
      while (a.bounds[slice + 1] <= c) ++slice;
      const int nc = int(std::min<int64_t>({int64_t(V), c1 - c, a.bounds[slice + 1] - c}));
      for (int64_t q = c + PF_ROWS, ps = slice; q < std::min(N, c + PF_ROWS + nc); ++q) {
        while (a.bounds[ps + 1] <= q) ++ps;   // B rows PF_ROWS ahead (their slice's R columns)
        __builtin_prefetch(wb + (l * N + q) * SR + ps * R);
      }
      W* rows[256];   // the slot's tokens' y rows at column c, in passes of up to 256 tokens
      for (int64_t q0 = 0; q0 < n; q0 += 256) {
        const int64_t m = std::min<int64_t>(256, n - q0);
        for (int64_t q = 0; q < m; ++q) rows[q] = static_cast<W*>(a.y) + s.tok[p0 + q0 + q] * a.y_ts + c;
        const W* b = wb + (l * N + c) * SR + slice * R;
        const float* sp = s.s + (p0 + q0) * SR + slice * R;
#ifdef PR_LORA_AVX512
        if (R == V && nc == V) {
          expand16<W>(b, SR, sp, SR, rows, m);
          continue;
        }
#endif
        expand_any<W>(b, SR, nc, R, sp, SR, rows, m);
      }
      c += nc;
    }
  });
}
template <class W>
void embed_item(int64_t i, const int64_t* ids, W* y, int64_t y_ts, const int32_t* token_lora, const W* lora_a,
                const W* lora_b, int64_t T, int64_t V, int64_t H, int64_t L, int64_t R) {
  alignas(64) float z[MR][MAX_RANK];
  const int64_t end = std::min(T, (i + 1) * MR);
  for (int64_t t0 = i * MR; t0 < end;) {
    const int32_t l = token_lora[t0];
    int64_t t1 = t0 + 1;
    while (t1 < end && token_lora[t1] == l) ++t1;
    if (l >= 0 && l < L) {
      const int mr = int(t1 - t0);
      const float* zp[MR];
      for (int m = 0; m < mr; ++m) {
        const int64_t id = std::min(std::max(ids[t0 + m], int64_t(0)), V - 1);
        const W* row = lora_a + (l * V + id) * R;
        for (int64_t r = 0; r < R; ++r) z[m][r] = load1(row, r);
        zp[m] = z[m];
      }
      const W* b = lora_b + l * H * R;
      for (int64_t h0 = 0; h0 < H; h0 += NR) {
        const int nr = int(std::min<int64_t>(NR, H - h0));
        const W* w[NR];
        for (int n = 0; n < NR; ++n) w[n] = b + (h0 + std::min(n, nr - 1)) * R;
        float res[MR][NR];
        dot<W>(mr, nr, zp, w, R, res);
        for (int m = 0; m < mr; ++m) {
          W* out = y + (t0 + m) * y_ts + h0;
          for (int n = 0; n < nr; ++n) {
            if constexpr (sizeof(W) == 2)
              out[n] = f32_to_bf16(bf16_to_f32(out[n]) + res[m][n]);
            else
              out[n] += res[m][n];
          }
        }
      }
    }
    t0 = t1;
  }
}
}  // namespace

extern "C" {

// 1 when this build's LoRA kernel uses AVX-512F (widening bfloat16 by shifts), 0 for plain loops.
int pr_lora_simd() {
#ifdef PR_LORA_AVX512
  return 1;
#else
  return 0;
#endif
}

// Bytes of scratch pr_lora needs for chunks of `chunk` tokens.
int64_t pr_lora_scratch_bytes(int64_t chunk, int64_t in, int64_t L, int64_t S, int64_t R) {
  return layout(chunk, in, L, S * R, nullptr, nullptr);
}

// y[t] (row stride y_ts) += its slot's adapter update for t < T, in place: see the top of this
// file. dtype 0: float32 x, y, lora_a, lora_b; 1: bfloat16. token_lora int32 [T]; lora_a
// [L, S*R, in] and lora_b [L, out, S*R] contiguous; bounds int64 [S + 1] (0, the slices' ends,
// the last = out). scratch: pr_lora_scratch_bytes(chunk, in, L, S, R) bytes. Returns 0, or 1
// for unsupported arguments (L > 256, R > 512, bad bounds or sizes).
int pr_lora(int dtype, const void* x, int64_t x_ts, void* y, int64_t y_ts, const int32_t* token_lora,
            const void* lora_a, const void* lora_b, const int64_t* bounds, int64_t T, int64_t in, int64_t out,
            int64_t L, int64_t S, int64_t R, void* scratch, int64_t chunk) {
  if (in < 1 || out < 1 || L < 1 || L > 256 || S < 1 || R < 1 || R > MAX_RANK || chunk < 1 || T < 0 || (dtype != 0 && dtype != 1) ||
      bounds[0] != 0 || bounds[S] != out)
    return 1;
  for (int64_t i = 0; i < S; ++i)
    if (bounds[i + 1] < bounds[i]) return 1;
  const Args a{dtype, x, x_ts, y, y_ts, token_lora, lora_a, lora_b, bounds, in, out, L, S, R};
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 63) / 64 * 64);
  Scratch s;
  layout(chunk, in, L, S * R, base, &s);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = group(a, t0, std::min(chunk, T - t0), s);
    if (n == 0) continue;
    if (dtype)
      apply<uint16_t>(a, n, s);
    else
      apply<float>(a, n, s);
  }
  return 0;
}

// y[t] (row stride y_ts) += lora_a[l, ids[t]] @ lora_b[l].T for t < T, l = token_lora[t] in
// [0, L) (other tokens are left as they are), ids clamped to [0, V). dtype 0: float32 y, lora_a,
// lora_b; 1: bfloat16. ids int64 [T]; lora_a [L, V, R], lora_b [L, H, R] contiguous. Returns 0,
// or 1 for unsupported arguments (R > 512, bad sizes).
int pr_lora_embed(int dtype, const int64_t* ids, void* y, int64_t y_ts, const int32_t* token_lora, const void* lora_a,
                  const void* lora_b, int64_t T, int64_t V, int64_t H, int64_t L, int64_t R) {
  if (V < 1 || H < 1 || L < 1 || R < 1 || R > MAX_RANK || T < 0 || (dtype != 0 && dtype != 1)) return 1;
  run_items((T + MR - 1) / MR, [&](int64_t i) {
    if (dtype)
      embed_item(i, ids, static_cast<uint16_t*>(y), y_ts, token_lora, static_cast<const uint16_t*>(lora_a),
                 static_cast<const uint16_t*>(lora_b), T, V, H, L, R);
    else
      embed_item(i, ids, static_cast<float*>(y), y_ts, token_lora, static_cast<const float*>(lora_a),
                 static_cast<const float*>(lora_b), T, V, H, L, R);
  });
  return 0;
}
}
