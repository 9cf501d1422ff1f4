// Small-M bfloat16 linear on AMX tiles: y[M, N] = x[M, K] @ w[N, K]^T, M <= 64.
//
// Decode steps multiply a few rows by every weight of the model, so they are
// bound by reading the weights: this kernel streams each weight exactly once,
// pre-packed at load time into AMX B tiles (VNNI pairs, 1 KiB each, contiguous
// per 16 output features), and keeps the whole x (padded to 16-row tiles) next
// to the core. Output features are split over the OpenMP threads.
//
// Packed layout: wp[N / 16][K / 32][16][32]: tile (nb, kb) row r holds, for
// columns c = 0..15, the pair w[nb*16 + c][kb*32 + 2r], w[nb*16 + c][kb*32 + 2r + 1].
// fp32 accumulation; one rounding to bfloat16 (nearest even) at the end.

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) \
    && !defined(PR_PORTABLE)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PR_AMX 1
#endif

extern "C" {

// 0 when AMX tiles are usable by this process (asks Linux for the tile state);
// 1: not compiled in (no AMX on the build CPU, or PR_PORTABLE); 2: Linux refused.
int pr_amx_init() {
#ifdef PR_AMX
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : 2;
#else
  return 1;
#endif
}

// w[N, K] (row-major) -> wp in the tile layout above; N % 16 == 0, K % 32 == 0.
void pr_amx_pack_bf16(const uint16_t* w, uint16_t* wp, int64_t N, int64_t K) {
  const int64_t nkb = K / 32;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t kb = 0; kb < nkb; ++kb) {
      uint16_t* t = wp + (nb * nkb + kb) * 512;
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t c = 0; c < 16; ++c)
          for (int64_t p = 0; p < 2; ++p)
            t[r * 32 + 2 * c + p] = w[(nb * 16 + c) * K + kb * 32 + 2 * r + p];
    }
}

#ifdef PR_AMX
namespace {
// The 16 x 16 floats of tile c (output rows m0.., features n0..) -> bfloat16 y, rows < M only.
inline void store_bf16(const float (*c)[16], int64_t m0, int64_t M, uint16_t* y, int64_t y_ts, int64_t n0) {
  for (int64_t i = 0; i < 16 && m0 + i < M; ++i)  // round to nearest even, NaN kept
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + i) * y_ts + n0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c[i])));
}
}  // namespace
#endif

// y[m, n] (row stride y_ts) for m < M <= 64; x rows of K with stride x_ts. Returns 0 on success.
int pr_amx_linear_bf16(const uint16_t* x, int64_t x_ts, const uint16_t* wp, uint16_t* y, int64_t y_ts,
                       int64_t M, int64_t N, int64_t K) {
#ifdef PR_AMX
  if (M < 1 || M > 64 || N % 16 || K % 32) return 1;
  const int64_t mb = (M + 15) / 16, nkb = K / 32, nnb = N / 16;
  // x padded to Mp = mb * 16 rows (zeros) and blocked [K / 32][Mp][32]: every A tile
  // (16 rows x 32 values) is 1 KiB of contiguous memory
  const int64_t Mp = mb * 16;
  uint16_t* xp = static_cast<uint16_t*>(aligned_alloc(64, size_t(Mp * K * 2)));
  if (xp == nullptr) return 3;
  for (int64_t kb = 0; kb < nkb; ++kb)
    for (int64_t m = 0; m < Mp; ++m) {
      uint16_t* dst = xp + (kb * Mp + m) * 32;
      if (m < M) std::memcpy(dst, x + m * x_ts + kb * 32, 64);
      else std::memset(dst, 0, 64);
    }
#pragma omp parallel if (N * K >= 65536)
  {
    alignas(64) uint8_t cfg[64] = {0};
    cfg[0] = 1;  // palette 1: every tile 16 rows x 64 bytes
    for (int t = 0; t < 8; ++t) {
      cfg[16 + 2 * t] = 64;
      cfg[48 + t] = 16;
    }
    _tile_loadconfig(cfg);
    alignas(64) float c[4][16][16];
    if (mb >= 2 && nnb % 2 == 0) {
      // 2 x 2 register blocking: 32 features x 32 rows per pass, each weight tile
      // read from memory once (the second row pass finds it in cache)
#pragma omp for schedule(static)
      for (int64_t np = 0; np < nnb / 2; ++np) {
        const uint16_t* w0 = wp + 2 * np * nkb * 512;
        const uint16_t* w1 = w0 + nkb * 512;
        for (int64_t m0 = 0; m0 < mb * 16; m0 += 32) {
          const bool two = m0 + 16 < mb * 16;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t kb = 0; kb < nkb; ++kb) {
            if (m0 == 0 && np + 2 < nnb / 2) {
              const char* nx = reinterpret_cast<const char*>(w0 + (4 * nkb + 2 * kb) * 512);
              for (int l = 0; l < 2048; l += 64) _mm_prefetch(nx + l, _MM_HINT_T1);
            }
            _tile_loadd(6, w0 + kb * 512, 64);
            _tile_loadd(7, w1 + kb * 512, 64);
            const uint16_t* xa = xp + (kb * Mp + m0) * 32;
            _tile_loadd(4, xa, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
              _tile_loadd(5, xa + 16 * 32, 64);
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          store_bf16(c[0], m0, M, y, y_ts, 32 * np);
          store_bf16(c[1], m0, M, y, y_ts, 32 * np + 16);
          if (two) {
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            store_bf16(c[2], m0 + 16, M, y, y_ts, 32 * np);
            store_bf16(c[3], m0 + 16, M, y, y_ts, 32 * np + 16);
          }
        }
      }
    } else {
  #pragma omp for schedule(static)
      for (int64_t nb = 0; nb < nnb; ++nb) {
        const uint16_t* wt = wp + nb * nkb * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < nkb; ++kb) {
          if (nb + 2 < nnb) {  // prefetch (to L2) the tile two feature blocks ahead
            const char* nx = reinterpret_cast<const char*>(wt + (2 * nkb + kb) * 512);
            for (int l = 0; l < 1024; l += 64) _mm_prefetch(nx + l, _MM_HINT_T1);
          }
          _tile_loadd(4, wt + kb * 512, 64);
          const uint16_t* xa = xp + kb * Mp * 32;
          _tile_loadd(5, xa, 64);
          _tile_dpbf16ps(0, 5, 4);
          if (mb > 1) {
            _tile_loadd(6, xa + 16 * 32, 64);
            _tile_dpbf16ps(1, 6, 4);
          }
          if (mb > 2) {
            _tile_loadd(7, xa + 32 * 32, 64);
            _tile_dpbf16ps(2, 7, 4);
          }
          if (mb > 3) {
            _tile_loadd(5, xa + 48 * 32, 64);
            _tile_dpbf16ps(3, 5, 4);
          }
        }
        _tile_stored(0, c[0], 64);
        if (mb > 1) _tile_stored(1, c[1], 64);
        if (mb > 2) _tile_stored(2, c[2], 64);
        if (mb > 3) _tile_stored(3, c[3], 64);
        for (int64_t b = 0; b < mb; ++b) store_bf16(c[b], 16 * b, M, y, y_ts, 16 * nb);
      }
    }
    _tile_release();
  }
  free(xp);
  return 0;
#else
  return 1;
#endif
}
}
