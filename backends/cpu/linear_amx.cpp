// Bfloat16 linear on AMX tiles: y[M, N] = x[M, K] @ w[N, K]^T, any M.
//
// Weights are packed once at load time into AMX B tiles (VNNI pairs, 1 KiB
// each, contiguous per 16 output features). A task is 32 output features (two
// B tiles wide) over a block of rows: for each panel of 32 rows it runs the whole K
// with 2 x 2 tiles of sums, so the task's weight tiles are read from memory once
// per block (decode: one panel) and from cache by the later panels (prefill). A
// block is as many rows as fit in BLOCK_BYTES of x (every task of a block reads
// them from L2, not from memory: at 2048 rows x 576 one block of all rows ran
// 1.9x slower than blocks of 896, Xeon AMX). A tiles are
// loaded straight from x with its row stride (the graphs' and torch's buffers are
// 64-byte aligned); only a last block of fewer than 16 rows, or an x that is not
// aligned, is copied into a zero-padded, aligned buffer. Tasks are shared out in chunks
// through `thread_pool.cpp` (a thread descheduled on a shared host delays only
// the chunk it holds), each chunk configuring the tiles on its own thread.
//
// Packed layout: wp[N / 16][K / 32][16][32]: tile (nb, kb) row r holds, for
// columns c = 0..15, the pair w[nb*16 + c][kb*32 + 2r], w[nb*16 + c][kb*32 + 2r + 1].
// fp32 accumulation; one rounding to bfloat16 (nearest even) at the end.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "thread_pool.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__) \
    && !defined(PR_PORTABLE)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PR_AMX 1
#include "amx_tiles.h"
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
}  // extern "C"

#ifdef PR_AMX
namespace {
constexpr int64_t BLOCK_BYTES = 1 << 20;  // of x per row block (L2 is 2 MiB per core on Sapphire Rapids)

struct Call {
  const uint16_t* x;
  int64_t x_ts;           // x's row stride (elements)
  const uint16_t* tail;   // rows [full, M) of x padded with zeros to whole 16-row blocks, row stride K
  int64_t full;           // rows in whole 16-row blocks
  const uint16_t* wp;
  uint16_t* y;
  int64_t y_ts, M, nnb, nkb, per_chunk;
  int64_t block_rows;       // rows per row block (a multiple of 32; M when there is one block)
  int64_t chunks_per_block; // chunks of tasks per row block
};

// The A tile source for rows m0..m0+15: x itself, or the aligned copy.
inline const uint16_t* rows_at(const Call& c, int64_t m0, int64_t& stride_bytes) {
  if (m0 < c.full) {
    stride_bytes = c.x_ts * 2;
    return c.x + m0 * c.x_ts;
  }
  stride_bytes = c.nkb * 64;
  return c.tail + (m0 - c.full) * c.nkb * 32;
}

// The 16 x 16 floats of a C tile (rows m0.., features n0..) -> bfloat16 y, rows < M only.
inline void store_bf16(const float (*t)[16], int64_t m0, int64_t M, uint16_t* y, int64_t y_ts, int64_t n0) {
  for (int64_t i = 0; i < 16 && m0 + i < M; ++i)  // round to nearest even, NaN kept
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + i) * y_ts + n0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(t[i])));
}

// Tasks [chunk * per_chunk, ...): task t = feature blocks 2t, 2t + 1 (the second absent at an odd end).
void run_chunk(void* ctx, int64_t chunk_id, int) {
  const Call& c = *static_cast<const Call*>(ctx);
  const int64_t block = chunk_id / c.chunks_per_block, chunk = chunk_id % c.chunks_per_block;
  const int64_t m_lo = block * c.block_rows, m_hi = std::min(c.M, m_lo + c.block_rows);
  const int64_t ntasks = (c.nnb + 1) / 2, t1 = std::min(ntasks, (chunk + 1) * c.per_chunk);
  const int64_t tile_bytes = c.nkb * 1024;  // one feature block's weights
  pr::configure_tiles_16x64();
  alignas(64) float acc[4][16][16];
  for (int64_t t = chunk * c.per_chunk; t < t1; ++t) {
    const int64_t nb = 2 * t;
    const bool two_n = nb + 1 < c.nnb;
    const uint16_t* w0 = c.wp + nb * c.nkb * 512;
    const uint16_t* w1 = two_n ? w0 + c.nkb * 512 : w0;
    const char* next = reinterpret_cast<const char*>(w0 + 2 * c.nkb * 512);  // the next task's weights
    const bool prefetch = nb + 2 < c.nnb;
    for (int64_t m0 = m_lo; m0 < m_hi; m0 += 32) {
      const bool two_m = m0 + 16 < m_hi;
      int64_t sa0, sa1 = 0;
      const uint16_t* a0 = rows_at(c, m0, sa0);
      const uint16_t* a1 = two_m ? rows_at(c, m0 + 16, sa1) : a0;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < c.nkb; ++kb) {
        if (m0 == m_lo && prefetch)  // while streaming this task's weights, fetch the next's (to L2)
          for (int64_t l = 0; l < 2048 && kb * 2048 + l < 2 * tile_bytes; l += 64)
            _mm_prefetch(next + kb * 2048 + l, _MM_HINT_T1);
        _tile_loadd(6, w0 + kb * 512, 64);
        _tile_loadd(4, a0 + kb * 32, sa0);
        _tile_dpbf16ps(0, 4, 6);
        if (two_n) {
          _tile_loadd(7, w1 + kb * 512, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_m) {
          _tile_loadd(5, a1 + kb * 32, sa1);
          _tile_dpbf16ps(2, 5, 6);
          if (two_n) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, acc[0], 64);
      store_bf16(acc[0], m0, c.M, c.y, c.y_ts, 16 * nb);
      if (two_n) {
        _tile_stored(1, acc[1], 64);
        store_bf16(acc[1], m0, c.M, c.y, c.y_ts, 16 * nb + 16);
      }
      if (two_m) {
        _tile_stored(2, acc[2], 64);
        store_bf16(acc[2], m0 + 16, c.M, c.y, c.y_ts, 16 * nb);
        if (two_n) {
          _tile_stored(3, acc[3], 64);
          store_bf16(acc[3], m0 + 16, c.M, c.y, c.y_ts, 16 * nb + 16);
        }
      }
    }
  }
  _tile_release();
}
}  // namespace
#endif

extern "C" {
// y[m, n] (row stride y_ts) for m < M; x rows of K with stride x_ts (unit stride on K); wp packed
// by pr_amx_pack_bf16. Returns 0 on success, 1 when not compiled in or the shapes are unsupported.
int pr_amx_linear_bf16(const uint16_t* x, int64_t x_ts, const uint16_t* wp, uint16_t* y, int64_t y_ts,
                       int64_t M, int64_t N, int64_t K) {
#ifdef PR_AMX
  if (M < 1 || N % 16 || K % 32) return 1;
  // Rows [full, M) are copied into a reused (no allocation per call), zero-padded, 64-byte aligned
  // buffer: the last block of fewer than 16 rows, or all of x when x is not aligned; a tile load
  // whose rows straddle cache lines is ~6x slower (2.2 vs 14.5 ns per 1 KiB tile, Xeon AMX).
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 64 == 0 && x_ts % 32 == 0;
  const int64_t full = aligned ? M / 16 * 16 : 0;
  thread_local std::vector<uint16_t> tail_buf;
  uint16_t* tail = nullptr;
  if (full < M) {
    const int64_t rows = (M - full + 15) / 16 * 16;
    tail_buf.assign(size_t(rows * K + 32), 0);
    tail = tail_buf.data() + (64 - reinterpret_cast<uintptr_t>(tail_buf.data()) % 64) % 64 / 2;
    for (int64_t m = full; m < M; ++m) std::memcpy(tail + (m - full) * K, x + m * x_ts, size_t(K) * 2);
  }
  const int64_t block_rows = std::max<int64_t>(32, BLOCK_BYTES / (2 * K) / 32 * 32);
  Call c{x, x_ts, tail, full, wp, y, y_ts, M, N / 16, K / 32, 0, M, 1};
  if (M > block_rows) c.block_rows = block_rows;
  const int64_t ntasks = (c.nnb + 1) / 2, blocks = (M + c.block_rows - 1) / c.block_rows;
  const int64_t threads = N * K >= 65536 ? pr::pool_helpers() + 1 : 1;
  c.per_chunk = threads > 1 ? std::max<int64_t>(1, ntasks / (4 * threads)) : ntasks;
  c.chunks_per_block = (ntasks + c.per_chunk - 1) / c.per_chunk;
  pr::parallel_for(blocks * c.chunks_per_block, run_chunk, &c);
  return 0;
#else
  (void)x, (void)x_ts, (void)wp, (void)y, (void)y_ts, (void)M, (void)N, (void)K;
  return 1;
#endif
}
}  // extern "C"
