// Quantized linear: y[M, N] = x[M, K] @ W[N, K]^T with W kept in GGUF blocks.
//
// W rows are GGUF (llama.cpp) blocks, exactly as in the file: Q8_0, Q4_0,
// Q4_1 (32 weights per block) or Q4_K (256 per super-block, 8 sub-blocks of
// 32) here; Q6_K, Q5_K, Q3_K, Q2_K in quant_kquants.cpp (Q6_K's and Q5_K's r8
// layouts in quant_kquants_r8.cpp), Q5_0, Q5_1, IQ4_NL, IQ4_XS in quant_small.cpp
// (their r8 layouts in quant_small_r8.cpp; these keep the GGUF bits per weight),
// run through their `TypeKernels` (quant_common.h) by this file's driver (the
// activation rows, with per-16 sums for the types with 16-weight sub-blocks; the
// threads; the calls). x (float32 or bfloat16) is quantized per row on the fly to int8 blocks
// of 32 (scale d = max|x| / 127, like llama.cpp's Q8_0/Q8_1, with the block's
// sum d * sum(q) kept for the weights' offsets), so every block dot product is
// an integer one: unsigned 4-bit (or |int8|) weights x signed int8
// activations, 4 products summed per 32-bit lane:
//   ISA 3: AVX-512 VNNI (vpdpbusd, 256-bit EVEX)      native build only
//   ISA 2: AVX-VNNI     (vpdpbusd, 256-bit VEX)        native build only
//   ISA 1: AVX2         (vpmaddubsw + vpmaddwd)         both builds
//   ISA 0: scalar C++                                   everywhere
// Per block: int32 sum -> float, times d_w * d_x, accumulated in float.
// Block formulas (q: stored integers, d/m/dmin: float16 scales):
//   Q8_0  w = d q (q int8)            Q4_0  w = d (q - 8)        Q4_1  w = d q + m
//   Q4_K  w = d sc_j q - dmin mn_j    (sc_j, mn_j 6-bit, packed in 12 bytes)
// Row-interleaved layout ("r8", the decode path of the 4-bit types): `pr_quant_repack8` turns
// Q4_0/Q4_1 rows into groups of 8 output rows; per group and block of 32 inputs: 128 bytes of
// nibbles (32-bit lane r of 32-byte vector k holds row r's weights 4k..4k+3 in the low nibbles and
// 16+4k..16+4k+3 in the high ones), then the 8 rows' float16 d (and for Q4_1 their m; Q4_0's
// offset -8 d is computed): exactly the GGUF bytes. Q4_K's r8 layout (super-blocks of 256, the
// file's bytes too) is in quant_kquants_r8.cpp, with Q5_K's, the kernels for its GGUF blocks here. One
// vector op then serves 8 output rows (scales in lanes, activations broadcast), instead of a
// horizontal sum per row: about a third of the instructions per weight. Q8_0 (the LM head of
// the usual GGUF files) has an r8 layout too, on the VNNI paths: per group and block, 256 bytes
// (32-bit lane r of vector k: row r's weights 4k..4k+3, each + 128, so unsigned for `vpdpbusd`;
// the dot's excess, 128 * sum(x), is taken off in integers), then the 8 rows' float16 d.
// `maddubs` (AVX2) would saturate on 255 * 127 * 2, so the AVX2 path keeps the GGUF layout.
// No AMX-INT8 path: not written (no AMX on the machines it is tested on).
// Threads: output rows are split into chunks run by the decode kernels' work-sharing pool
// (`thread_pool.cpp`: a helper whose core another process holds cannot stall the call; inline
// when the pool is not started); dequantising for prefill uses OpenMP, load-time repacking one thread.

#include <algorithm>
#include <vector>

#include "quant_common.h"
#include "thread_pool.h"

namespace {

using namespace prq;

// The kernels of a type quant_kquants.cpp or quant_small.cpp implements; null for the others.
inline const TypeKernels* other_kernels(int qt) {
  const TypeKernels* k = kquant_kernels(qt);
  return k ? k : small_kernels(qt);
}

// Bytes and weights per block of GGML type qt (0 bytes: a type no file runs).
inline int block_bytes(int qt) {
  switch (qt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
  }
  const TypeKernels* k = other_kernels(qt);
  return k ? k->block_bytes : 0;
}
inline int block_size(int qt) {
  const TypeKernels* k = other_kernels(qt);
  return k ? k->block_size : qt == Q4_K ? 256 : 32;
}

// x's row -> int8 blocks of 32: d = max|x| / 127, q = round-to-nearest-even(x 127 / max|x|).
void quantize_row_scalar(const void* x, int bf16, int64_t K, int8_t* q, float* d, float* s, int32_t* qsum) {
  float v[32];
  for (int64_t b = 0; b < K / 32; ++b) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) {
      v[j] = bf16 ? bf2f(static_cast<const uint16_t*>(x)[b * 32 + j]) : static_cast<const float*>(x)[b * 32 + j];
      amax = std::fmax(amax, std::fabs(v[j]));
    }
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      const int qi = (int)std::nearbyint(v[j] * inv);
      q[b * 32 + j] = (int8_t)qi;
      sum += qi;
    }
    d[b] = scale;
    s[b] = scale * (float)sum;
    qsum[b] = sum;
  }
}

#ifdef PRQ_AVX2
// The same with AVX2, bit for bit (cvtps rounds to nearest even, as nearbyint in the default
// mode; NaN inputs are ignored by the max as by fmax). Every step's activations pass here once
// per linear: the scalar loop's libm calls cost more than a small layer's dot products.
void quantize_row_avx2(const void* x, int bf16, int64_t K, int8_t* q, float* d, float* s, int32_t* qsum) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) {
      if (bf16) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + b * 32 + 8 * i));
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else {
        v[i] = _mm256_loadu_ps(static_cast<const float*>(x) + b * 32 + 8 * i);
      }
    }
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(_mm256_and_ps(v[i], absmask), mx);  // NaN lanes keep mx
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    const int sum = _mm_cvtsi128_si32(t4);
    const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), _mm256_permutevar8x32_epi32(p16, order));
    d[b] = scale;
    s[b] = scale * (float)sum;
    qsum[b] = sum;
  }
}
#endif

// Per 16 quantized inputs, their sum (|sum| <= 16 * 127: int16).
void half_sums(const int8_t* q, int64_t K, int16_t* out) {
  for (int64_t h = 0; h < K / 16; ++h) {
    int t = 0;
    for (int i = 0; i < 16; ++i) t += q[16 * h + i];
    out[h] = (int16_t)t;
  }
}

// x's row quantized for the dot products (per block: q, its scale d, d * sum(q) and sum(q)).
void quantize_row(const void* x, int bf16, int64_t K, int8_t* q, float* d, float* s, int32_t* qsum) {
#ifdef PRQ_AVX2
  quantize_row_avx2(x, bf16, K, q, d, s, qsum);
#else
  quantize_row_scalar(x, bf16, K, q, d, s, qsum);
#endif
}

// ---- scalar rows ------------------------------------------------------------------
// out[m] = dot(W row, x row m) for MB activation rows.
template <int QT, int MB>
void row_scalar(const uint8_t* w, int64_t K, const QRow* a, float* out) {
  for (int m = 0; m < MB; ++m) out[m] = 0.f;
  if (QT == Q4_K) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* blk = w + sb * 144;
      const float d = h2f(blk), dmin = h2f(blk + 2);
      const uint8_t* qs = blk + 16;
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min_k4(j, blk + 4, &sc, &mn);
        const int64_t ab = sb * 8 + j;
        for (int m = 0; m < MB; ++m) {
          const int8_t* xq = a[m].q + ab * 32;
          int sum = 0;
          for (int i = 0; i < 32; ++i) sum += ((qs[(j / 2) * 32 + i] >> (4 * (j & 1))) & 0xF) * xq[i];
          out[m] += d * sc * a[m].d[ab] * (float)sum - dmin * mn * a[m].s[ab];
        }
      }
    }
    return;
  }
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = w + b * block_bytes(QT);
    const float d = h2f(blk);
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = a[m].q + b * 32;
      int sum = 0;
      if (QT == Q8_0) {
        const int8_t* wq = reinterpret_cast<const int8_t*>(blk + 2);
        for (int i = 0; i < 32; ++i) sum += wq[i] * xq[i];
        out[m] += d * a[m].d[b] * (float)sum;
      } else {
        const uint8_t* qs = blk + (QT == Q4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) sum += (qs[i] & 0xF) * xq[i] + (qs[i] >> 4) * xq[i + 16];
        out[m] += d * a[m].d[b] * (float)sum;
        out[m] += QT == Q4_1 ? h2f(blk + 2) * a[m].s[b] : -8.f * d * a[m].s[b];
      }
    }
  }
}

// ---- SIMD rows --------------------------------------------------------------------
#ifdef PRQ_AVX2
template <int ISA, int QT, int MB>
void row_simd(const uint8_t* w, int64_t K, const QRow* a, float* out) {
  __m256 acc[MB];
  float corr[MB];
  for (int m = 0; m < MB; ++m) {
    acc[m] = _mm256_setzero_ps();
    corr[m] = 0.f;
  }
  if (QT == Q4_K) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const uint8_t* blk = w + sb * 144;
      const float d = h2f(blk), dmin = h2f(blk + 2);
      int sc[8], mn[8];
      for (int j = 0; j < 8; ++j) scale_min_k4(j, blk + 4, &sc[j], &mn[j]);
      for (int j = 0; j < 4; ++j) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j));
        const __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        const int64_t ab = sb * 8 + 2 * j;
        const float s0 = d * sc[2 * j], s1 = d * sc[2 * j + 1];
        block_fma<ISA, MB>(lo, s0, ab, a, acc);
        block_fma<ISA, MB>(hi, s1, ab + 1, a, acc);
      }
      for (int m = 0; m < MB; ++m) {
        float c = 0.f;
        for (int j = 0; j < 8; ++j) c += mn[j] * a[m].s[sb * 8 + j];
        corr[m] -= dmin * c;
      }
    }
  } else {
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = w + b * block_bytes(QT);
      _mm_prefetch(reinterpret_cast<const char*>(blk + PF_BYTES), _MM_HINT_T0);
      const float d = h2f(blk);
      if (QT == Q8_0) {
        const __m256i wq = load32(reinterpret_cast<const int8_t*>(blk + 2));
        block_fma_signed<ISA, MB>(wq, d, b, a, acc);
      } else {
        const __m256i wq = nibbles32(blk + (QT == Q4_1 ? 4 : 2));
        const float off = QT == Q4_1 ? h2f(blk + 2) : -8.f * d;
        block_fma<ISA, MB>(wq, d, b, a, acc);
        for (int m = 0; m < MB; ++m) corr[m] += off * a[m].s[b];
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]) + corr[m];
}
#endif  // PRQ_AVX2


// ---- row-interleaved ("r8") layouts ------------------------------------------------------
// The r8 kernels of a type another file implements (the `TypeKernels` types, and Q4_K's layout in
// quant_kquants_r8.cpp, whose GGUF-layout kernels are here), else null: this file's 32-input r8
// blocks (Q4_0, Q4_1, Q8_0).
inline const R8Kernels* r8_kernels(int qt) {
  if (const TypeKernels* k = other_kernels(qt)) return &k->r8;
  static const R8Kernels q4k = kquant_r8(Q4_K);
  return qt == Q4_K && q4k.unit ? &q4k : nullptr;
}
// Bytes of this file's r8 blocks (8 rows of 32 inputs): 128 of nibbles, then the 8 rows' float16 d
// (and for Q4_1 their m): exactly the GGUF blocks' bytes; Q8_0: 256 of values, then d.
inline int64_t r8_block_bytes(int qt) { return qt == Q8_0 ? 256 + 16 : qt == Q4_1 ? 128 + 32 : 128 + 16; }
// Bytes of one r8 group (8 rows of K weights).
inline int64_t r8_group_bytes(int qt, int64_t K) {
  const R8Kernels* k = r8_kernels(qt);
  return k ? K / k->unit * k->unit_bytes : K / 32 * r8_block_bytes(qt);
}

#ifdef PRQ_AVX2
// out[m][0..7] = the 8 rows of a Q4_0 / Q4_1 group times activation rows a[0..MB). The scale and
// offset terms go to separate accumulators (two dependent FMAs a block were the loop's carried
// chain); the offset is m (Q4_1) or -8 d (Q4_0).
template <int ISA, int QT, int MB>
void group8(const uint8_t* gp, int64_t nb, const QRow* a, float (*out)[8]) {
  constexpr int64_t bb = QT == Q4_1 ? 128 + 32 : 128 + 16;
  __m256 acc[MB], off[MB];
  for (int m = 0; m < MB; ++m) acc[m] = off[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = gp + b * bb;
    prefetch(p, bb);
    __m256i lo[4], hi[4];
    load_r8_q(p, false, lo, hi);
    const __m256 d = load_f16x8(p + 128);
    const __m256 mo = QT == Q4_1 ? load_f16x8(p + 144) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    for (int m = 0; m < MB; ++m) {
      const __m256i s = block_dot4bit<ISA>(lo, hi, a[m].q + b * 32);
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[m].d[b])), _mm256_cvtepi32_ps(s), acc[m]);
      off[m] = _mm256_fmadd_ps(mo, _mm256_set1_ps(a[m].s[b]), off[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out[m], _mm256_add_ps(acc[m], off[m]));
}

#if defined(PRQ_AVXVNNI) || defined(PRQ_AVX512VNNI)
// group8 for Q8_0's r8 blocks (w + 128 as unsigned bytes; the 8 rows' d after them). Per row of x,
// C independent `vpdpbusd` chains (C = 4, or 2 when MB > 2 keeps AVX-VNNI's 16 registers enough).
template <int ISA, int MB>
void group8_q8(const uint8_t* gp, int64_t nb, const QRow* a, float (*out)[8]) {
  constexpr int C = MB > 2 ? 2 : 4;
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = gp + b * (256 + 16);
    for (int64_t e = 0; e < 256 + 16; e += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PF_BYTES + e), _MM_HINT_T0);
    __m256i s[MB][C];
    for (int m = 0; m < MB; ++m) {
      s[m][0] = _mm256_set1_epi32(-128 * a[m].qsum[b]);  // the + 128's excess
      for (int c = 1; c < C; ++c) s[m][c] = _mm256_setzero_si256();
    }
    for (int k = 0; k < 8; ++k) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k));
      for (int m = 0; m < MB; ++m) s[m][k % C] = dpbusd8<ISA>(s[m][k % C], w, bcast4(a[m].q + b * 32 + 4 * k));
    }
    const __m256 d = load_f16x8(p + 256);
    for (int m = 0; m < MB; ++m) {
      __m256i t = s[m][0];
      for (int c = 1; c < C; ++c) t = _mm256_add_epi32(t, s[m][c]);
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a[m].d[b])), _mm256_cvtepi32_ps(t), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out[m], acc[m]);
}
#endif

template <int QT>
struct Groups {  // pick_kernel's family: the r8 group kernels of Q4_0, Q4_1 and Q8_0 (Q8_0: VNNI only)
  template <int ISA, int MB>
  static constexpr GroupFn simd() {
    if constexpr (QT == Q8_0) {
#if defined(PRQ_AVXVNNI) || defined(PRQ_AVX512VNNI)
      if constexpr (ISA != AVX2) return group8_q8<ISA, MB>;
#endif
      return nullptr;
    } else {
      return group8<ISA, QT, MB>;
    }
  }
  template <int MB>
  static constexpr GroupFn scalar() { return nullptr; }
};

GroupFn pick_group(int isa, int mb, int qt) {
  switch (qt) {
    case Q4_0: return pick_kernel<Groups<Q4_0>>(isa, mb);
    case Q4_1: return pick_kernel<Groups<Q4_1>>(isa, mb);
    case Q8_0: return pick_kernel<Groups<Q8_0>>(isa, mb);
  }
  return nullptr;
}
#endif  // PRQ_AVX2

template <int QT>
struct Rows {  // pick_kernel's family: the GGUF-layout kernels of Q4_0, Q4_1, Q8_0 and Q4_K
  template <int ISA, int MB>
  static constexpr RowFn simd() {
#ifdef PRQ_AVX2
    return row_simd<ISA, QT, MB>;
#else
    return nullptr;
#endif
  }
  template <int MB>
  static constexpr RowFn scalar() { return row_scalar<QT, MB>; }
};

RowFn pick(int qt, int isa, int mb) {
  switch (qt) {
    case Q4_0: return pick_kernel<Rows<Q4_0>>(isa, mb);
    case Q4_1: return pick_kernel<Rows<Q4_1>>(isa, mb);
    case Q8_0: return pick_kernel<Rows<Q8_0>>(isa, mb);
    case Q4_K: return pick_kernel<Rows<Q4_K>>(isa, mb);
  }
  const TypeKernels* k = other_kernels(qt);
  return k && mb >= 1 && mb <= MB_MAX ? k->row(isa, mb) : nullptr;
}

bool isa_compiled(int isa) {
  switch (isa) {
    case SCALAR: return true;
#ifdef PRQ_AVX2
    case AVX2: return true;
#endif
#ifdef PRQ_AVXVNNI
    case AVXVNNI: return true;
#endif
#ifdef PRQ_AVX512VNNI
    case AVX512VNNI: return true;
#endif
  }
  return false;
}


inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = f2bf(v); }

// Dequantising fewer weights than this runs on the calling thread: an OpenMP team's fork and join
// cost more than the work (quant_rows.cpp's one row per token: ~1 us of work, a fork 100s of us on a
// loaded host).
constexpr int64_t PARALLEL_WEIGHTS = 1 << 16;

// Rows of W -> out[N, K]; one block at a time through a float buffer (the loops vectorise).
template <typename T>
void dequantize_rows(int qt, const uint8_t* w, int64_t N, int64_t K, T* out) {
  const int64_t bs = block_size(qt), nblk = K / bs, row_bytes = nblk * block_bytes(qt);
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_WEIGHTS)
  for (int64_t n = 0; n < N; ++n) {
    float v[256];
    for (int64_t b = 0; b < nblk; ++b) {
      const uint8_t* blk = w + n * row_bytes + b * block_bytes(qt);
      const float d = h2f(blk);
      if (qt == Q8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int i = 0; i < 32; ++i) v[i] = d * (float)q[i];
      } else if (qt == Q4_0 || qt == Q4_1) {
        const uint8_t* qs = blk + (qt == Q4_1 ? 4 : 2);
        const float mn = qt == Q4_1 ? h2f(blk + 2) : -8.f * d;
        for (int i = 0; i < 16; ++i) {
          v[i] = d * (float)(qs[i] & 0xF) + mn;
          v[i + 16] = d * (float)(qs[i] >> 4) + mn;
        }
      } else {  // Q4_K
        const float dmin = h2f(blk + 2);
        for (int j = 0; j < 8; ++j) {
          int sc, mn;
          scale_min_k4(j, blk + 4, &sc, &mn);
          const uint8_t* qs = blk + 16 + (j / 2) * 32;
          const float a = d * sc, c = dmin * mn;
          const int shift = 4 * (j & 1);
          for (int i = 0; i < 32; ++i) v[j * 32 + i] = a * (float)((qs[i] >> shift) & 0xF) - c;
        }
      }
      T* o = out + n * K + b * bs;
      for (int64_t i = 0; i < bs; ++i) put(o + i, v[i]);
    }
  }
}

// The same for rows [n0, n1) of the types of `TypeKernels` (their decode, block of 32 by block).
template <typename T>
void dequantize_decoded(DecodeFn decode, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K,
                        T* out) {
  int16_t v[32];
  float s[2], m[2];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < K / 32; ++b) {
      decode(w + n * row_bytes, b, v, s, m);
      T* o = out + n * K + b * 32;
      for (int i = 0; i < 32; ++i) put(o + i, s[i / 16] * (float)v[i] - m[i / 16]);
    }
}

template <typename T>
void dequantize_any(int qt, const uint8_t* w, int64_t N, int64_t K, T* out) {
  const TypeKernels* k = other_kernels(qt);
  if (!k) return dequantize_rows(qt, w, N, K, out);
  const int64_t row_bytes = K / k->block_size * k->block_bytes;
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_WEIGHTS)
  for (int64_t n = 0; n < N; ++n) dequantize_decoded(k->decode, w, row_bytes, n, n + 1, K, out);
}

// r8 groups of an `R8Kernels` layout -> out[N, K] (the group's own dequantisation, then rounded to T).
template <typename T>
void dequantize_groups(const R8Kernels* k, const uint8_t* w8, int64_t N, int64_t K, T* out) {
  const int64_t gbytes = K / k->unit * k->unit_bytes;
#pragma omp parallel if (N * K >= PARALLEL_WEIGHTS)
  {
    std::vector<float> rows(8 * K);
#pragma omp for schedule(static)
    for (int64_t g = 0; g < N / 8; ++g) {
      k->dequant(w8 + g * gbytes, K, rows.data());
      T* o = out + g * 8 * K;
      for (int64_t i = 0; i < 8 * K; ++i) put(o + i, rows[i]);
    }
  }
}

// One call of either layout: activations quantized, output rows in chunks over the pool.
struct Call {
  const uint8_t* w;
  int64_t N, K, M, ldy, rows_per_chunk;
  const QRow* rows;
  void* y;
  int y_bf16, qt, isa;
  bool r8;
};

void run_chunk(void* ctx, int64_t chunk, int) {
  const Call& c = *static_cast<const Call*>(ctx);
  if (c.r8) {
#ifdef PRQ_AVX2
    const int64_t nb = c.K / 32, gbytes = r8_group_bytes(c.qt, c.K), ng = c.N / 8;
    const R8Kernels* k = r8_kernels(c.qt);
    for (int64_t g = chunk * c.rows_per_chunk; g < ng && g < (chunk + 1) * c.rows_per_chunk; ++g) {
      float out[MB_MAX][8];
      for (int64_t m0 = 0; m0 < c.M; m0 += MB_MAX) {
        const int mb = (int)(c.M - m0 < MB_MAX ? c.M - m0 : MB_MAX);
        (k ? k->group(c.isa, mb) : pick_group(c.isa, mb, c.qt))(c.w + g * gbytes, nb, c.rows + m0, out);
        for (int i = 0; i < mb; ++i)
          for (int r = 0; r < 8; ++r) store(c.y, c.y_bf16, (m0 + i) * c.ldy + g * 8 + r, out[i][r]);
      }
    }
#endif
    return;
  }
  const int64_t row_bytes = c.K / block_size(c.qt) * block_bytes(c.qt);
  const int64_t n0 = chunk * c.rows_per_chunk, n1 = std::min(c.N, n0 + c.rows_per_chunk);
  float out[MB_MAX];
  for (int64_t m0 = 0; m0 < c.M; m0 += MB_MAX) {
    const int mb = (int)(c.M - m0 < MB_MAX ? c.M - m0 : MB_MAX);
    const RowFn fn = pick(c.qt, c.isa, mb);
    for (int64_t n = n0; n < n1; ++n) {
      fn(c.w + n * row_bytes, c.K, c.rows + m0, out);
      for (int i = 0; i < mb; ++i) store(c.y, c.y_bf16, (m0 + i) * c.ldy + n, out[i]);
    }
  }
}

// Quantize x's rows, then run the output rows (groups of 8 with r8) in chunks, ~8 per thread.
void linear(Call c, const void* x, int64_t ldx, int x_bf16) {
  const int64_t nb = c.K / 32;
  thread_local std::vector<int8_t> q;  // per calling thread, grown once: no allocation per call
  thread_local std::vector<float> ds;
  thread_local std::vector<int32_t> sums;
  thread_local std::vector<int16_t> sums16;
  thread_local std::vector<QRow> rows;
  const TypeKernels* k = other_kernels(c.qt);
  const bool sum16 = k && k->sum16;
  q.resize(std::max<size_t>(q.size(), size_t(c.M * c.K)));
  ds.resize(std::max<size_t>(ds.size(), size_t(2 * c.M * nb)));
  sums.resize(std::max<size_t>(sums.size(), size_t(c.M * nb)));
  if (sum16) sums16.resize(std::max<size_t>(sums16.size(), size_t(2 * c.M * nb)));
  rows.resize(std::max<size_t>(rows.size(), size_t(c.M)));
  for (int64_t m = 0; m < c.M; ++m) {
    rows[m] = {q.data() + m * c.K, ds.data() + 2 * m * nb, ds.data() + (2 * m + 1) * nb, sums.data() + m * nb,
               sum16 ? sums16.data() + 2 * m * nb : nullptr};
    quantize_row(static_cast<const char*>(x) + m * ldx * (x_bf16 ? 2 : 4), x_bf16, c.K, q.data() + m * c.K,
                 ds.data() + 2 * m * nb, ds.data() + (2 * m + 1) * nb, sums.data() + m * nb);
    if (sum16) half_sums(q.data() + m * c.K, c.K, sums16.data() + 2 * m * nb);
  }
  c.rows = rows.data();
  const int64_t units = c.r8 ? c.N / 8 : c.N;
  // the pool from ~16K units x inputs (Zen 4, 1 row, weights in L2: 256 x 576 3.9 -> 3.4 us,
  // 576 x 576 6.7 -> 4.7 us; 64 x 576 2.1 us alone, 2.4 shared); below, one inline chunk
  const int64_t threads = units * c.K >= 16384 ? pr::pool_helpers() + 1 : 1;
  c.rows_per_chunk = threads == 1 ? units : std::max<int64_t>(1, (units + 8 * threads - 1) / (8 * threads));
  pr::parallel_for((units + c.rows_per_chunk - 1) / c.rows_per_chunk, run_chunk, &c);
}

}  // namespace

extern "C" {

// 1 when this build has the instruction-set path `isa` (0 scalar, 1 AVX2, 2 AVX-VNNI, 3 AVX-512 VNNI).
int pr_quant_isa_compiled(int isa) { return isa_compiled(isa) ? 1 : 0; }

// The fastest path this build has.
int pr_quant_best_isa() {
  for (int isa = AVX512VNNI; isa > SCALAR; --isa)
    if (isa_compiled(isa)) return isa;
  return SCALAR;
}

// x's row of K (a multiple of 32) as the kernels quantize it: per block of 32, q[32], d, d * sum(q)
// and sum(q); simd: 1 the AVX2 code the kernels run where compiled, 0 the scalar loop. Returns 1
// when simd is asked for and this build has none (a test hook: both must agree bit for bit).
int pr_quant_quantize_row(int simd, const void* x, int bf16, int64_t K, int8_t* q, float* d, float* s,
                          int32_t* qsum) {
  if (simd) {
#ifdef PRQ_AVX2
    quantize_row_avx2(x, bf16, K, q, d, s, qsum);
    return 0;
#else
    return 1;
#endif
  }
  quantize_row_scalar(x, bf16, K, q, d, s, qsum);
  return 0;
}

// Bytes and weights per block of GGML type `qt`; 0 for a type this file does not run.
int pr_quant_block_bytes(int qt) { return block_bytes(qt); }
int pr_quant_block_size(int qt) { return block_bytes(qt) ? block_size(qt) : 0; }

// y[M, N] (row stride ldy; float32, or bfloat16 when y_bf16) = x[M, K] (row stride ldx; float32, or
// bfloat16 when x_bf16) @ W^T, W: N rows of K / block_size(qt) blocks, contiguous. Returns 0, or
// 1 for an unknown type / path, 2 when K is not a multiple of the block size.
int pr_quant_linear(int qt, const uint8_t* w, int64_t N, int64_t K, const void* x, int64_t ldx, int x_bf16,
                    int64_t M, void* y, int64_t ldy, int y_bf16, int isa) {
  if (!block_bytes(qt) || !isa_compiled(isa) || !pick(qt, isa, 1)) return 1;
  if (K % block_size(qt)) return 2;
  linear(Call{w, N, K, M, ldy, 0, nullptr, y, y_bf16, qt, isa, false}, x, ldx, x_bf16);
  return 0;
}

// out[N, K] (float32, or bfloat16 when out_bf16) = the weights of W (layout as above). Returns 0, or
// 1 for an unknown type, 2 when K is not a multiple of the block size.
int pr_quant_dequantize(int qt, const uint8_t* w, int64_t N, int64_t K, void* out, int out_bf16) {
  if (!block_bytes(qt)) return 1;
  if (K % block_size(qt)) return 2;
  if (out_bf16)
    dequantize_any(qt, w, N, K, static_cast<uint16_t*>(out));
  else
    dequantize_any(qt, w, N, K, static_cast<float*>(out));
  return 0;
}


// 1 when `qt` can be repacked into the r8 layout and this build has a path for it (AVX2 at least).
int pr_quant_r8_supported(int qt) {
#ifdef PRQ_AVX2
  if (qt == Q8_0) return isa_compiled(AVXVNNI) || isa_compiled(AVX512VNNI);
  if (const R8Kernels* k = r8_kernels(qt)) return k->unit && k->group(AVX2, 1) ? 1 : 0;
  return qt == Q4_0 || qt == Q4_1;
#else
  (void)qt;
  return 0;
#endif
}

// 1 when path `isa` of this build runs the r8 layout of `qt` (Q8_0: the VNNI paths only).
int pr_quant_r8_isa(int qt, int isa) {
  if (!pr_quant_r8_supported(qt) || isa == SCALAR || !isa_compiled(isa)) return 0;
  if (const R8Kernels* k = r8_kernels(qt)) return k->group(isa, 1) ? 1 : 0;
  return !(qt == Q8_0 && isa == AVX2);
}

// Bytes of the r8 copy of N rows of K weights (N % 8 == 0, K a multiple of the block size).
int64_t pr_quant_r8_bytes(int qt, int64_t N, int64_t K) { return N / 8 * r8_group_bytes(qt, K); }

// W (N rows of GGUF blocks of type qt) -> out in the r8 layout. 0, or 1 unsupported, 2 bad shape.
int pr_quant_repack8(int qt, const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  if (!pr_quant_r8_supported(qt)) return 1;
  if (N % 8 || K % block_size(qt)) return 2;
  const int64_t nb = K / 32, row_bytes = K / block_size(qt) * block_bytes(qt), bb = r8_block_bytes(qt);
  if (const R8Kernels* k = r8_kernels(qt)) {
    const int64_t gbytes = r8_group_bytes(qt, K);
    for (int64_t g = 0; g < N / 8; ++g) k->repack(w + g * 8 * row_bytes, row_bytes, K, out + g * gbytes);
    return 0;
  }
  for (int64_t g = 0; g < N / 8; ++g)  // one thread: ~1 ms per million weights, and no barrier to stall on
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* p = out + (g * nb + b) * bb;
      if (qt == Q8_0) {
        for (int r = 0; r < 8; ++r) {
          const uint8_t* blk = w + (g * 8 + r) * row_bytes + b * 34;
          for (int k = 0; k < 8; ++k)
            for (int i = 0; i < 4; ++i) p[32 * k + 4 * r + i] = uint8_t(blk[2 + 4 * k + i] ^ 0x80);  // w + 128
          std::memcpy(p + 256 + 2 * r, blk, 2);  // d, float16 as it is
        }
        continue;
      }
      for (int r = 0; r < 8; ++r) {  // Q4_0 / Q4_1: the nibbles moved, d (and m) as they are
        const uint8_t* blk = w + (g * 8 + r) * row_bytes + b * block_bytes(qt);
        const uint8_t* qs = blk + (qt == Q4_1 ? 4 : 2);
        for (int k = 0; k < 4; ++k) std::memcpy(p + 32 * k + 4 * r, qs + 4 * k, 4);  // inputs 4k + i, 16 + 4k + i
        std::memcpy(p + 128 + 2 * r, blk, 2);
        if (qt == Q4_1) std::memcpy(p + 144 + 2 * r, blk + 2, 2);
      }
    }
  return 0;
}

// pr_quant_linear for W in the r8 layout of type qt (isa: 1..3). Same returns.
int pr_quant_linear8(int qt, const uint8_t* w8, int64_t N, int64_t K, const void* x, int64_t ldx, int x_bf16,
                     int64_t M, void* y, int64_t ldy, int y_bf16, int isa) {
  if (!pr_quant_r8_isa(qt, isa)) return 1;
  if (N % 8 || K % block_size(qt)) return 2;
  linear(Call{w8, N, K, M, ldy, 0, nullptr, y, y_bf16, qt, isa, true}, x, ldx, x_bf16);
  return 0;
}

// out[N, K] (float32, or bfloat16 when out_bf16) = the weights of an r8 copy. 0, or 1 / 2 as above.
int pr_quant_dequantize8(int qt, const uint8_t* w8, int64_t N, int64_t K, void* out, int out_bf16) {
  if (!pr_quant_r8_supported(qt)) return 1;
  if (N % 8 || K % block_size(qt)) return 2;
  if (const R8Kernels* k = r8_kernels(qt)) {
    if (out_bf16)
      dequantize_groups(k, w8, N, K, static_cast<uint16_t*>(out));
    else
      dequantize_groups(k, w8, N, K, static_cast<float*>(out));
    return 0;
  }
  const int64_t nb = K / 32, bb = r8_block_bytes(qt);
#pragma omp parallel for schedule(static) if (N * K >= PARALLEL_WEIGHTS)
  for (int64_t g = 0; g < N / 8; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = w8 + (g * nb + b) * bb;
      if (qt == Q8_0) {
        for (int r = 0; r < 8; ++r) {
          const float d = h2f(p + 256 + 2 * r);
          for (int k = 0; k < 8; ++k)
            for (int i = 0; i < 4; ++i)
              store(out, out_bf16, (g * 8 + r) * K + b * 32 + 4 * k + i, d * float(int(p[32 * k + 4 * r + i]) - 128));
        }
        continue;
      }
      for (int r = 0; r < 8; ++r) {
        const float d = h2f(p + 128 + 2 * r), m = qt == Q4_1 ? h2f(p + 144 + 2 * r) : -8.f * d;
        float v[32];
        for (int k = 0; k < 4; ++k)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = p[32 * k + 4 * r + i];
            v[4 * k + i] = d * (float)(byte & 0xF) + m;
            v[16 + 4 * k + i] = d * (float)(byte >> 4) + m;
          }
        const int64_t base = (g * 8 + r) * K + b * 32;
        for (int i = 0; i < 32; ++i) store(out, out_bf16, base + i, v[i]);
      }
    }
  return 0;
}

}  // extern "C"
