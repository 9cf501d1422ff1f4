// Quantized linear: y[M, N] = x[M, K] @ W[N, K]^T with W kept in GGUF blocks.
//
// W rows are GGUF (llama.cpp) blocks, exactly as in the file: Q8_0, Q4_0,
// Q4_1 (32 weights per block) or Q4_K (256 per super-block, 8 sub-blocks of
// 32). x (float32 or bfloat16) is quantized per row on the fly to int8 blocks
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
// No AMX-INT8 path: not written (no AMX on the machines it is tested on).
// OpenMP: activations quantized over rows, then output features split over threads.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PRQ_AVX2 1
#endif
#if defined(PRQ_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(PR_PORTABLE)
#define PRQ_AVX512VNNI 1
#endif
#if defined(PRQ_AVX2) && defined(__AVXVNNI__) && !defined(PR_PORTABLE)
#define PRQ_AVXVNNI 1
#endif

namespace {

enum QType { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12 };  // GGML type ids
enum Isa { SCALAR = 0, AVX2 = 1, AVXVNNI = 2, AVX512VNNI = 3 };

inline float h2f(const uint8_t* p) {  // little-endian IEEE float16 -> float
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef PRQ_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal float16: exact in float
    float f = std::ldexp((float)man, -24);
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2bf(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

inline void store(void* y, int bf16, int64_t i, float v) {
  if (bf16)
    static_cast<uint16_t*>(y)[i] = f2bf(v);
  else
    static_cast<float*>(y)[i] = v;
}

inline int block_bytes(int qt) {
  switch (qt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
  }
  return 0;
}
inline int block_size(int qt) { return qt == Q4_K ? 256 : 32; }

// Q4_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One activation row quantized: q[K] int8, per block of 32 its scale d and d * sum(q).
struct QRow {
  const int8_t* q;
  const float* d;
  const float* s;
};

void quantize_row(const void* x, int bf16, int64_t K, int8_t* q, float* d, float* s) {
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
  }
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
template <int ISA>
inline __m256i dot_u8s8(__m256i u, __m256i s);  // lane i: sum of u[4i..4i+3] * s[4i..4i+3]
template <>
inline __m256i dot_u8s8<AVX2>(__m256i u, __m256i s) {  // |products| <= 15*127*2 or 128*127*2: no saturation
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#ifdef PRQ_AVXVNNI
template <>
inline __m256i dot_u8s8<AVXVNNI>(__m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
}
#endif
#ifdef PRQ_AVX512VNNI
template <>
inline __m256i dot_u8s8<AVX512VNNI>(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#endif

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i nibbles32(const uint8_t* qs) {  // 16 bytes -> 32 values: low nibbles, then high nibbles
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

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
        for (int m = 0; m < MB; ++m) {
          const __m256i p0 = dot_u8s8<ISA>(lo, load32(a[m].q + ab * 32));
          const __m256i p1 = dot_u8s8<ISA>(hi, load32(a[m].q + ab * 32 + 32));
          acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(s0 * a[m].d[ab]), _mm256_cvtepi32_ps(p0), acc[m]);
          acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(s1 * a[m].d[ab + 1]), _mm256_cvtepi32_ps(p1), acc[m]);
        }
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
      const float d = h2f(blk);
      if (QT == Q8_0) {
        const __m256i wq = load32(reinterpret_cast<const int8_t*>(blk + 2));
        const __m256i u = _mm256_sign_epi8(wq, wq);  // |w|, and x takes w's sign
        for (int m = 0; m < MB; ++m) {
          const __m256i p = dot_u8s8<ISA>(u, _mm256_sign_epi8(load32(a[m].q + b * 32), wq));
          acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[m].d[b]), _mm256_cvtepi32_ps(p), acc[m]);
        }
      } else {
        const __m256i wq = nibbles32(blk + (QT == Q4_1 ? 4 : 2));
        const float off = QT == Q4_1 ? h2f(blk + 2) : -8.f * d;
        for (int m = 0; m < MB; ++m) {
          const __m256i p = dot_u8s8<ISA>(wq, load32(a[m].q + b * 32));
          acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * a[m].d[b]), _mm256_cvtepi32_ps(p), acc[m]);
          corr[m] += off * a[m].s[b];
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum(acc[m]) + corr[m];
}
#endif  // PRQ_AVX2

using RowFn = void (*)(const uint8_t*, int64_t, const QRow*, float*);

template <int QT, int MB>
RowFn pick_mb(int isa) {
  switch (isa) {
#ifdef PRQ_AVX512VNNI
    case AVX512VNNI: return row_simd<AVX512VNNI, QT, MB>;
#endif
#ifdef PRQ_AVXVNNI
    case AVXVNNI: return row_simd<AVXVNNI, QT, MB>;
#endif
#ifdef PRQ_AVX2
    case AVX2: return row_simd<AVX2, QT, MB>;
#endif
    case SCALAR: return row_scalar<QT, MB>;
  }
  return nullptr;
}

constexpr int MB_MAX = 4;  // activation rows per weight-row pass (accumulators in registers)

template <int QT>
RowFn pick_qt(int isa, int mb) {
  switch (mb) {
    case 1: return pick_mb<QT, 1>(isa);
    case 2: return pick_mb<QT, 2>(isa);
    case 3: return pick_mb<QT, 3>(isa);
    case 4: return pick_mb<QT, 4>(isa);
  }
  return nullptr;
}

RowFn pick(int qt, int isa, int mb) {
  switch (qt) {
    case Q4_0: return pick_qt<Q4_0>(isa, mb);
    case Q4_1: return pick_qt<Q4_1>(isa, mb);
    case Q8_0: return pick_qt<Q8_0>(isa, mb);
    case Q4_K: return pick_qt<Q4_K>(isa, mb);
  }
  return nullptr;
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

// Rows of W -> out[N, K]; one block at a time through a float buffer (the loops vectorise).
template <typename T>
void dequantize_rows(int qt, const uint8_t* w, int64_t N, int64_t K, T* out) {
  const int64_t bs = block_size(qt), nblk = K / bs, row_bytes = nblk * block_bytes(qt);
#pragma omp parallel for schedule(static)
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
  const int64_t nb = K / 32, row_bytes = K / block_size(qt) * block_bytes(qt);
  std::vector<int8_t> q(M * K);
  std::vector<float> ds(2 * M * nb);
  std::vector<QRow> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = {q.data() + m * K, ds.data() + 2 * m * nb, ds.data() + (2 * m + 1) * nb};
  const int64_t CHUNK = 16;  // weight rows kept hot in cache while every activation tile passes
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      quantize_row(static_cast<const char*>(x) + m * ldx * (x_bf16 ? 2 : 4), x_bf16, K, q.data() + m * K,
                   ds.data() + 2 * m * nb, ds.data() + (2 * m + 1) * nb);
#pragma omp for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += CHUNK) {
      float out[MB_MAX];
      for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
        const int mb = (int)(M - m0 < MB_MAX ? M - m0 : MB_MAX);
        const RowFn fn = pick(qt, isa, mb);
        for (int64_t n = n0; n < N && n < n0 + CHUNK; ++n) {
          fn(w + n * row_bytes, K, rows.data() + m0, out);
          for (int i = 0; i < mb; ++i) store(y, y_bf16, (m0 + i) * ldy + n, out[i]);
        }
      }
    }
  }
  return 0;
}

// out[N, K] (float32, or bfloat16 when out_bf16) = the weights of W (layout as above). Returns 0, or
// 1 for an unknown type, 2 when K is not a multiple of the block size.
int pr_quant_dequantize(int qt, const uint8_t* w, int64_t N, int64_t K, void* out, int out_bf16) {
  if (!block_bytes(qt)) return 1;
  if (K % block_size(qt)) return 2;
  if (out_bf16)
    dequantize_rows(qt, w, N, K, static_cast<uint16_t*>(out));
  else
    dequantize_rows(qt, w, N, K, static_cast<float*>(out));
  return 0;
}

}  // extern "C"
