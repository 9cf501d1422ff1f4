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
// positions p <= its own and, with a sliding window w > 0, p > pos - w.
// Requests with no queries or seq_len 0 (padding) are skipped; output rows of
// tokens outside [qsl[r_begin], qsl[r_end]) are not touched.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float ld(float x) { return x; }
inline float ld(uint16_t x) {  // bfloat16 bits -> float
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void st(float* p, float f) { *p = f; }
inline void st(uint16_t* p, float f) {  // float -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { *p = uint16_t((u >> 16) | 0x40); return; }  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = uint16_t(u >> 16);
}

constexpr int64_t QT = 16;  // queries per tile

// exp(x) for x <= 0 (softmax after max subtraction): 2^(x log2 e) split into
// 2^n * 2^f, f in [-0.5, 0.5], degree-6 Taylor for 2^f (relative error ~1e-8).
// Branch-free, so the compiler vectorises the loops that call it.
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float t = x * 1.4426950408889634f;
  const float n = __builtin_rintf(t);
  const float f = t - n;
  float p = 1.5403530393381608e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.f;
  uint32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += uint32_t(int32_t(n)) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

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

template <typename T>
void attend(const T* q, int64_t q_ts, const T* cache, int64_t NB, int64_t bs, int64_t Hkv,
            int64_t D, const int32_t* qsl, const int32_t* seq_lens, const int32_t* bt,
            int64_t bt_stride, T* out, int64_t o_ts, int64_t r_begin, int64_t r_end, int64_t Hq,
            float scale, int64_t window) {
  const int64_t G = Hq / Hkv;
  const int64_t n_items = (r_end - r_begin) * Hkv;
  const int64_t row = Hkv * D;
  const T* kc = cache;
  const T* vc = cache + NB * bs * row;
  const float NEG = -std::numeric_limits<float>::infinity();
#pragma omp parallel
  {
    std::vector<float> qf(QT * G * D), acc(QT * G * D), kf(bs * D), vf(bs * D), s(QT * G * bs);
    std::vector<float> m(QT * G), l(QT * G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const int64_t r = r_begin + it / Hkv, hk = it % Hkv;
      const int64_t q0 = qsl[r], nq = int64_t(qsl[r + 1]) - q0, L = seq_lens[r];
      if (nq <= 0 || L <= 0) continue;
      const int32_t* table = bt + r * bt_stride;
      for (int64_t t0 = 0; t0 < nq; t0 += QT) {
        const int64_t nt = std::min(QT, nq - t0), rows = nt * G;
        const int64_t pos_first = L - nq + t0, pos_last = pos_first + nt - 1;
        for (int64_t i = 0; i < nt; ++i)
          for (int64_t g = 0; g < G; ++g) {
            const T* src = q + (q0 + t0 + i) * q_ts + (hk * G + g) * D;
            float* dst = &qf[(i * G + g) * D];
            for (int64_t d = 0; d < D; ++d) dst[d] = ld(src[d]) * scale;
          }
        std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
        std::fill(m.begin(), m.begin() + rows, NEG);
        std::fill(l.begin(), l.begin() + rows, 0.f);
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos_first - window + 1) : 0;
        const int64_t hi = pos_last + 1;  // keys [lo, hi)
        for (int64_t b = lo / bs; b * bs < hi; ++b) {
          const int64_t blk = table[b];
          const int64_t j0 = std::max(b * bs, lo), j1 = std::min((b + 1) * bs, hi), nj = j1 - j0;
          const T* kb = kc + (blk * bs + (j0 - b * bs)) * row + hk * D;
          const T* vb = vc + (blk * bs + (j0 - b * bs)) * row + hk * D;
          for (int64_t j = 0; j < nj; ++j)
            for (int64_t d = 0; d < D; ++d) {
              kf[j * D + d] = ld(kb[j * row + d]);
              vf[j * D + d] = ld(vb[j * row + d]);
            }
          for (int64_t rr = 0; rr < rows; ++rr) {
            const int64_t pos = pos_first + rr / G;
            const float* qr = &qf[rr * D];
            float* sr = &s[rr * bs];
            float mx = m[rr];
            for (int64_t j = 0; j < nj; ++j) {
              const int64_t kp = j0 + j;
              if (kp > pos || (window > 0 && kp <= pos - window)) { sr[j] = NEG; continue; }
              float dot = 0.f;
              const float* kr = &kf[j * D];
              for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
              sr[j] = dot;
              mx = std::max(mx, dot);
            }
            if (mx == NEG) continue;  // nothing visible in this block yet
            const float corr = fast_exp(m[rr] - mx);
            m[rr] = mx;
            float* ar = &acc[rr * D];
            float sum = 0.f;
            for (int64_t j = 0; j < nj; ++j) {
              const float x = sr[j];
              const float p = x == NEG ? 0.f : fast_exp(x - mx);
              sr[j] = p;
              sum += p;
            }
            l[rr] = l[rr] * corr + sum;
            for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
            for (int64_t j = 0; j < nj; ++j) {
              const float p = sr[j];
              const float* vr = &vf[j * D];
              for (int64_t d = 0; d < D; ++d) ar[d] += p * vr[d];
            }
          }
        }
        for (int64_t i = 0; i < nt; ++i)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t rr = i * G + g;
            const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
            T* dst = out + (q0 + t0 + i) * o_ts + (hk * G + g) * D;
            const float* ar = &acc[rr * D];
            for (int64_t d = 0; d < D; ++d) st(dst + d, ar[d] * inv);
          }
      }
    }
  }
}

template <typename T>
void run(void* q, int64_t q_ts, void* k, int64_t k_ts, void* v, int64_t v_ts, void* cache,
         int64_t NB, int64_t bs, int64_t Hq, int64_t Hkv, int64_t D, const int64_t* slots,
         int64_t num_write, const int32_t* qsl, const int32_t* seq_lens, const int32_t* bt,
         int64_t bt_stride, void* out, int64_t o_ts, int64_t r_begin, int64_t r_end, float scale,
         int64_t window) {
  if (num_write > 0)
    write_kv<T>(static_cast<const T*>(k), k_ts, static_cast<const T*>(v), v_ts,
                static_cast<T*>(cache), NB * bs, slots, num_write, Hkv, D);
  if (r_end > r_begin)
    attend<T>(static_cast<const T*>(q), q_ts, static_cast<const T*>(cache), NB, bs, Hkv, D, qsl,
              seq_lens, bt, bt_stride, static_cast<T*>(out), o_ts, r_begin, r_end, Hq, scale,
              window);
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (q, k, v, cache and out share it).
int pr_paged_attention(int dtype, void* q, int64_t q_ts, void* k, int64_t k_ts, void* v,
                       int64_t v_ts, void* cache, int64_t NB, int64_t bs, int64_t Hq, int64_t Hkv,
                       int64_t D, const int64_t* slots, int64_t num_write, const int32_t* qsl,
                       const int32_t* seq_lens, const int32_t* bt, int64_t bt_stride, void* out,
                       int64_t o_ts, int64_t r_begin, int64_t r_end, float scale, int64_t window) {
  if (Hkv <= 0 || Hq % Hkv != 0) return 2;
  if (dtype == 0)
    run<float>(q, q_ts, k, k_ts, v, v_ts, cache, NB, bs, Hq, Hkv, D, slots, num_write, qsl,
               seq_lens, bt, bt_stride, out, o_ts, r_begin, r_end, scale, window);
  else if (dtype == 1)
    run<uint16_t>(q, q_ts, k, k_ts, v, v_ts, cache, NB, bs, Hq, Hkv, D, slots, num_write, qsl,
                  seq_lens, bt, bt_stride, out, o_ts, r_begin, r_end, scale, window);
  else
    return 1;
  return 0;
}

int pr_abi_version() { return 1; }
}
