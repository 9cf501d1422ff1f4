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
// Weights are read in place (the adapters are written into the slots between steps): bfloat16
// rows widened to float32 by a 16-bit shift (AVX-512F only) when loaded; each weight vector
// serves MR token rows. Work items are (slot, NR rows of A) for the shrink and (slot, TILE_N
// output columns) for the expand, shared out on the pool (thread_pool.h) in decode-sized steps
// or on the OpenMP team in prefill. No allocation: the caller passes `scratch` of
// pr_lora_scratch_bytes(chunk, ...) bytes and the tokens go in chunks of `chunk`.
// The portable build (PR_PORTABLE, CPUs without AVX-512) runs the same code with plain loops.

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
constexpr int64_t TILE_N = 64;       // expand item: 64 output columns of a slot (blocks of V)
constexpr int V = 16;                // output columns per transposed block of B (one vector)
constexpr int64_t MAX_RANK = 512;    // vLLM's largest max_lora_rank (the expand's stack buffer)
constexpr int64_t INLINE_WIDEN = 1 << 14;   // x elements widened on the caller, no pool dispatch

using namespace pr_widen;

// Items [0, n) on the pool (decode: torch's OpenMP has one thread) or the OpenMP team.
template <class Body>
void run_items(int64_t n, const Body& body) {
  if (n <= 0) return;
  const int team = omp_get_max_threads();
  if (n == 1) {
    body(int64_t(0));
  } else if (team > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    pr::parallel_for(n, [](void* c, int64_t i, int) { (*static_cast<const Body*>(c))(i); },
                     const_cast<Body*>(&body));
  }
}

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

// bt[r * V + q] = b[q * ld + r] (float32) for q < nc, r < R; zeros for q >= nc: the block of
// nc output rows of B (their R columns of one slice) transposed, R rows of V columns.
template <class W>
void transpose_block(const W* b, int64_t ld, int nc, int64_t R, float* bt) {
  int64_t r0 = 0;
#ifdef PR_LORA_AVX512
  if (nc == V) {
    for (; r0 + V <= R; r0 += V) {   // 16 x 16 in registers: unpack, shuffle, two lane shuffles
      __m512 m[V], t[V];
      for (int q = 0; q < V; ++q) m[q] = load16(b + q * ld + r0);
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
        float* col = bt + (r0 + j) * V;
        _mm512_storeu_ps(col, _mm512_shuffle_f32x4(u0, u2, 0x88));
        _mm512_storeu_ps(col + 4 * V, _mm512_shuffle_f32x4(u1, u3, 0x88));
        _mm512_storeu_ps(col + 8 * V, _mm512_shuffle_f32x4(u0, u2, 0xDD));
        _mm512_storeu_ps(col + 12 * V, _mm512_shuffle_f32x4(u1, u3, 0xDD));
      }
    }
  }
#endif
  for (int64_t r = r0; r < R; ++r)
    for (int q = 0; q < V; ++q) bt[r * V + q] = q < nc ? load1(b + q * ld, r) : 0.0f;
}

// y[c + q] += acc[q] for q < nc (y a row of float32 or bfloat16; bfloat16 rounded once).
inline void add_row(float* y, int nc, const float* acc) {
  for (int q = 0; q < nc; ++q) y[q] += acc[q];
}
inline void add_row(uint16_t* y, int nc, const float* acc) {
  for (int q = 0; q < nc; ++q) y[q] = f32_to_bf16(bf16_to_f32(y[q]) + acc[q]);
}

#ifdef PR_LORA_AVX512
inline __m256i to_bf16(__m512 v) {   // float32 -> bfloat16 (nearest even, NaN kept quiet), AVX-512F
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}
inline void add_vec(float* y, int nc, __m512 acc) {
  if (nc == V) {
    _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), acc));
  } else {
    const __mmask16 k = __mmask16((1u << nc) - 1);
    _mm512_mask_storeu_ps(y, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, y), acc));
  }
}
inline void add_vec(uint16_t* y, int nc, __m512 acc) {
  if (nc == V) {
    __m256i* p = reinterpret_cast<__m256i*>(y);
    _mm256_storeu_si256(p, to_bf16(_mm512_add_ps(load16(y), acc)));
  } else {
    alignas(64) float tmp[V];
    _mm512_store_ps(tmp, acc);
    add_row(y, nc, tmp);
  }
}
#endif

// Tokens [p0, p1) (sorted positions) of one slot: y[tok, c:c+nc] += s[p, off:off+R] @ bt (R x V).
template <class W>
void expand_block(const Args& a, const Scratch& s, int64_t p0, int64_t p1, int64_t off, int64_t c, int nc,
                  const float* bt) {
  const int64_t R = a.R, SR = a.S * a.R;
  auto yrow = [&](int64_t p) { return static_cast<W*>(a.y) + s.tok[p] * a.y_ts + c; };
  int64_t p = p0;
#ifdef PR_LORA_AVX512
  for (; p + 4 <= p1; p += 4) {   // four tokens: four independent FMA chains
    const float* s0 = s.s + p * SR + off;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t r = 0; r < R; ++r) {
      const __m512 w = _mm512_load_ps(bt + r * V);
      acc0 = _mm512_fmadd_ps(_mm512_set1_ps(s0[r]), w, acc0);
      acc1 = _mm512_fmadd_ps(_mm512_set1_ps(s0[SR + r]), w, acc1);
      acc2 = _mm512_fmadd_ps(_mm512_set1_ps(s0[2 * SR + r]), w, acc2);
      acc3 = _mm512_fmadd_ps(_mm512_set1_ps(s0[3 * SR + r]), w, acc3);
    }
    add_vec(yrow(p), nc, acc0);
    add_vec(yrow(p + 1), nc, acc1);
    add_vec(yrow(p + 2), nc, acc2);
    add_vec(yrow(p + 3), nc, acc3);
  }
  for (; p < p1; ++p) {   // one token: two chains (even and odd r)
    const float* s0 = s.s + p * SR + off;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) {
      acc0 = _mm512_fmadd_ps(_mm512_set1_ps(s0[r]), _mm512_load_ps(bt + r * V), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_set1_ps(s0[r + 1]), _mm512_load_ps(bt + (r + 1) * V), acc1);
    }
    if (r < R) acc0 = _mm512_fmadd_ps(_mm512_set1_ps(s0[r]), _mm512_load_ps(bt + r * V), acc0);
    add_vec(yrow(p), nc, _mm512_add_ps(acc0, acc1));
  }
#else
  for (; p < p1; ++p) {   // plain loops over the V columns (the compiler vectorises them)
    const float* s0 = s.s + p * SR + off;
    float acc[V] = {};
    for (int64_t r = 0; r < R; ++r)
      for (int q = 0; q < V; ++q) acc[q] += s0[r] * bt[r * V + q];
    add_row(yrow(p), nc, acc);
  }
#endif
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
    alignas(64) float bt[MAX_RANK * V];
    int64_t slice = 0;
    for (int64_t c = c0; c < c1;) {
      while (a.bounds[slice + 1] <= c) ++slice;
      const int nc = int(std::min<int64_t>({int64_t(V), c1 - c, a.bounds[slice + 1] - c}));
      transpose_block<W>(wb + (l * N + c) * SR + slice * R, SR, nc, R, bt);
      expand_block<W>(a, s, s.start[l], s.start[l + 1], slice * R, c, nc, bt);
      c += nc;
    }
  });
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
}
