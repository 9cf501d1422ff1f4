// The "moe" role's CPU kernel: one call per MoE layer (moe_module.py), vLLM's fused_experts.
//
// pr_moe(x [T, H], router_logits [T, E], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I])
// -> out [T, H], all in C++: routing (softmax or sigmoid in float32, the top_k largest, optional
// renormalisation), grouping the T * k (token, expert) pairs by expert (a counting sort), per
// expert the gate_up dot products of its rows, silu(gate) * up, the down dot products, and the
// weighted sum per token in float32, rounded once to the output dtype.
//
// Weights stay in their checkpoint layout (rows of K contiguous, the role's w13_weight and
// w2_weight): each output is a dot product over K, MR token rows x NR weight rows at a time, so
// a weight vector loaded (and, for bfloat16, widened to float32 by a 16-bit shift: AVX-512F
// only, no AVX512_BF16) serves MR rows. Decode is bound by reading the active experts' weights.
// Work items are (active expert, output-column tile), shared out on the pool (thread_pool.h)
// in decode-sized steps or on the OpenMP team in prefill, so every core works even at T = 1.
// No allocation: the caller passes `scratch` of pr_moe_scratch_bytes(chunk, ...) bytes and the
// tokens go in chunks of `chunk` (each chunk re-reads the active experts' weights).
// The portable build (PR_PORTABLE, CPUs without AVX-512) runs the same code with plain loops.
//
// pr_moe_quant is the same call over experts kept in GGUF blocks (a quantized GGUF file's 3-D
// stacks as the file holds them, moe_module.py's `QuantFusedMoE`): gate and up [E, I rows of H],
// down [E, H rows of I], each expert's rows contiguous, in the GGUF layout or the r8 layout of
// quant_gemm.cpp. The routing and the weighted sum are pr_moe's; in between, the chunk's x rows
// are gathered in expert order and each active expert's rows run through the quantized linear
// (`pr_quant_linear` / `..._linear8`: int8 activations, the pool's threads over the expert's output
// rows): gate and up into one [rows, 2I] buffer, silu(gate) * up in place, down. A decode step
// reads only its active experts' blocks.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__) && !defined(PR_PORTABLE)
#include <immintrin.h>
#define PR_MOE_AVX512 1
#endif

#include "thread_pool.h"
#include "widen_dot.h"

extern "C" {   // the quantized linears (quant_gemm.cpp)
int pr_quant_block_bytes(int qt);
int pr_quant_block_size(int qt);
int pr_quant_isa_compiled(int isa);
int pr_quant_r8_isa(int qt, int isa);
int64_t pr_quant_r8_bytes(int qt, int64_t N, int64_t K);
int pr_quant_linear(int qt, const uint8_t* w, int64_t N, int64_t K, const void* x, int64_t ldx, int x_bf16,
                    int64_t M, void* y, int64_t ldy, int y_bf16, int isa);
int pr_quant_linear8(int qt, const uint8_t* w8, int64_t N, int64_t K, const void* x, int64_t ldx, int x_bf16,
                     int64_t M, void* y, int64_t ldy, int y_bf16, int isa);
}

namespace {
constexpr int64_t TILE_I = 16;     // gate_up item: 16 columns of I (32 weight rows)
constexpr int64_t TILE_H = 32;     // down item: 32 columns of H

using namespace pr_widen;

// dot() of many token rows: bfloat16 weight rows are widened once into `buf` (NR * K floats, when
// K <= WIDEN_K) and every row block reads the float32 copy, instead of widening per row block.
constexpr int64_t WIDEN_K = 4096;

template <class W>
void dot_rows_block(int mr, int nr, const float* const* x, const W* const* w, int64_t K, float res[MR][NR],
                    const float* const* wide) {
  if (wide != nullptr)
    dot<float>(mr, nr, x, wide, K, res);
  else
    dot<W>(mr, nr, x, w, K, res);
}

// `wide` rows for weight rows `w` (nullptr: use them as they are): only for bfloat16 weights
// multiplied by more than MR token rows.
template <class W>
const float* const* widen(int nr, const W* const* w, int64_t K, int64_t rows, float* buf, const float** ptrs) {
  if (sizeof(W) != 2 || rows <= MR || K > WIDEN_K) return nullptr;
  for (int n = 0; n < nr; ++n) {
    for (int64_t k = 0; k < K; ++k) buf[n * K + k] = load1(w[n], k);
    ptrs[n] = buf + n * K;
  }
  return ptrs;
}

// The scratch of one chunk of up to C tokens (P = C * k pairs), 64-byte aligned pieces; `quant`
// (pr_moe_quant): x gathered per pair and the whole gate_up output kept, as the sizes say.
struct Scratch {
  float* xf;          // [C, H] the chunk's x in float32 (quant: [P, H], by sorted position)
  int32_t* ids;       // [P] pair p = t * k + j: its expert
  float* wts;         // [P] its routing weight
  int32_t* pos;       // [P] its position in the expert-sorted order
  int32_t* tok;       // [P] sorted position -> token
  int64_t* start;     // [E + 1] the experts' first sorted positions
  int32_t* active;    // [E] experts that received pairs
  float* act;         // [P, I] silu(gate) * up, by sorted position (quant: [P, 2I], gate_up, then act in
                      // the first I columns)
  float* y;           // [P, H] the expert outputs, by sorted position
};

inline int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }  // silu(gate) * up

int64_t layout(int64_t C, int64_t H, int64_t I, int64_t E, int64_t k, char* base, Scratch* s, bool quant = false) {
  const int64_t P = C * k;
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    char* p = base ? base + off : nullptr;
    off += align64(bytes);
    return p;
  };
  char* xf = take((quant ? P : C) * H * 4);
  char* ids = take(P * 4);
  char* wts = take(P * 4);
  char* pos = take(P * 4);
  char* tok = take(P * 4);
  char* start = take((E + 1) * 8);
  char* active = take(E * 4);
  char* act = take(P * I * (quant ? 8 : 4));
  char* y = take(P * H * 4);
  if (s) *s = {reinterpret_cast<float*>(xf), reinterpret_cast<int32_t*>(ids), reinterpret_cast<float*>(wts),
               reinterpret_cast<int32_t*>(pos), reinterpret_cast<int32_t*>(tok), reinterpret_cast<int64_t*>(start),
               reinterpret_cast<int32_t*>(active), reinterpret_cast<float*>(act), reinterpret_cast<float*>(y)};
  return off + 64;   // + slack to align the base
}

using pr::run_items;

struct Args {
  int dtype;   // 0 float32, 1 bfloat16 (x, weights, out; pr_moe_quant: x, out)
  const void* x;
  int64_t x_ts;
  const void* logits;
  int64_t l_ts;
  int logits_bf16;
  const void* w13;
  const void* w2;
  void* out;
  int64_t o_ts, H, I, E, k;
  bool renormalize, sigmoid;
};

// Scores, top-k and the expert-sorted order of tokens [t0, t0 + C).
void route(const Args& a, int64_t t0, int64_t C, const Scratch& s) {
  const int64_t E = a.E, k = a.k;
  float scores[1024];   // E <= 1024 (checked by pr_moe)
  for (int64_t e = 0; e <= E; ++e) s.start[e] = 0;
  for (int64_t t = 0; t < C; ++t) {
    const char* row = static_cast<const char*>(a.logits) + (t0 + t) * a.l_ts * (a.logits_bf16 ? 2 : 4);
    for (int64_t e = 0; e < E; ++e)
      scores[e] = a.logits_bf16 ? bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[e])
                                : reinterpret_cast<const float*>(row)[e];
    if (a.sigmoid) {
      for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-scores[e]));
    } else {
      float mx = scores[0], sum = 0.0f;
      for (int64_t e = 1; e < E; ++e) mx = scores[e] > mx ? scores[e] : mx;
      for (int64_t e = 0; e < E; ++e) sum += (scores[e] = std::exp(scores[e] - mx));
      for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
    }
    // the top k as torch.topk on a CPU picks them (aten's TopKImpl.h), ties included: the same
    // std::partial_sort (k * 64 <= E) or std::nth_element over (score, index) pairs in index order
    std::pair<double, int64_t> queue[1024];
    for (int64_t e = 0; e < E; ++e) queue[e] = {double(scores[e]), e};
    auto larger = [](const std::pair<double, int64_t>& p, const std::pair<double, int64_t>& q) {
      return (std::isnan(p.first) && !std::isnan(q.first)) || p.first > q.first;
    };
    if (k * 64 <= E)
      std::partial_sort(queue, queue + k, queue + E, larger);
    else
      std::nth_element(queue, queue + k - 1, queue + E, larger);
    float total = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t best = queue[j].second;
      s.ids[t * k + j] = int32_t(best);
      s.wts[t * k + j] = scores[best];
      total += scores[best];
      ++s.start[best + 1];
    }
    if (a.renormalize)
      for (int64_t j = 0; j < k; ++j) s.wts[t * k + j] /= total;
  }
  for (int64_t e = 0; e < E; ++e) s.start[e + 1] += s.start[e];
  int64_t fill[1024];
  for (int64_t e = 0; e < E; ++e) fill[e] = s.start[e];
  for (int64_t p = 0; p < C * k; ++p) {   // stable: a token's rows in token order per expert
    const int64_t q = fill[s.ids[p]]++;
    s.pos[p] = int32_t(q);
    s.tok[q] = int32_t(p / k);
  }
}

// out's rows [t0, t0 + C): per token the weighted sum of its pairs' expert outputs, in float32, rounded once.
void combine(const Args& a, int64_t t0, int64_t C, const Scratch& s) {
  const int64_t H = a.H, k = a.k;
  run_items((C + 7) / 8, [&](int64_t i) {
    float acc[8192];
    for (int64_t t = 8 * i; t < std::min(C, 8 * i + 8); ++t) {
      for (int64_t h = 0; h < H; ++h) acc[h] = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const float w = s.wts[t * k + j];
        const float* yr = s.y + int64_t(s.pos[t * k + j]) * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += w * yr[h];
      }
      char* row = static_cast<char*>(a.out) + (t0 + t) * a.o_ts * (a.dtype ? 2 : 4);
      for (int64_t h = 0; h < H; ++h) {
        if (a.dtype)
          reinterpret_cast<uint16_t*>(row)[h] = f32_to_bf16(acc[h]);
        else
          reinterpret_cast<float*>(row)[h] = acc[h];
      }
    }
  });
}

template <class W>
void experts(const Args& a, int64_t t0, int64_t C, const Scratch& s) {
  const int64_t H = a.H, I = a.I, E = a.E;
  // x -> float32
  run_items((C + 15) / 16, [&](int64_t i) {
    for (int64_t t = 16 * i; t < std::min(C, 16 * i + 16); ++t) {
      const char* row = static_cast<const char*>(a.x) + (t0 + t) * a.x_ts * (a.dtype ? 2 : 4);
      for (int64_t h = 0; h < H; ++h)
        s.xf[t * H + h] = a.dtype ? bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[h])
                                  : reinterpret_cast<const float*>(row)[h];
    }
  });
  int64_t na = 0;
  for (int64_t e = 0; e < E; ++e)
    if (s.start[e + 1] > s.start[e]) s.active[na++] = int32_t(e);
  const W* w13 = static_cast<const W*>(a.w13);
  const W* w2 = static_cast<const W*>(a.w2);
  // gate_up and silu(gate) * up: items (active expert, TILE_I columns of I)
  const int64_t ti = (I + TILE_I - 1) / TILE_I;
  run_items(na * ti, [&](int64_t item) {
    const int64_t e = s.active[item / ti], c0 = (item % ti) * TILE_I, c1 = std::min(I, c0 + TILE_I);
    const int64_t r0 = s.start[e], r1 = s.start[e + 1];
    const W* we = w13 + e * 2 * I * H;
    for (int64_t c = c0; c < c1; c += NR / 2) {   // NR / 2 columns: their gate and up rows
      const int nc = int(std::min<int64_t>(NR / 2, c1 - c));
      const W* wr[NR];
      for (int n = 0; n < nc; ++n) wr[n] = we + (c + n) * H, wr[nc + n] = we + (I + c + n) * H;
      alignas(64) float buf[NR * WIDEN_K];
      const float* ptrs[NR];
      const float* const* wide = widen<W>(2 * nc, wr, H, r1 - r0, buf, ptrs);
      for (int64_t r = r0; r < r1; r += MR) {
        const int mr = int(std::min<int64_t>(MR, r1 - r));
        const float* xr[MR];
        for (int m = 0; m < mr; ++m) xr[m] = s.xf + s.tok[r + m] * H;
        float res[MR][NR];
        dot_rows_block<W>(mr, 2 * nc, xr, wr, H, res, wide);
        for (int m = 0; m < mr; ++m)
          for (int n = 0; n < nc; ++n) {
            const float g = res[m][n];
            s.act[(r + m) * I + c + n] = silu_mul(g, res[m][nc + n]);
          }
      }
    }
  });
  // down: items (active expert, TILE_H columns of H)
  const int64_t th = (H + TILE_H - 1) / TILE_H;
  run_items(na * th, [&](int64_t item) {
    const int64_t e = s.active[item / th], h0 = (item % th) * TILE_H, h1 = std::min(H, h0 + TILE_H);
    const int64_t r0 = s.start[e], r1 = s.start[e + 1];
    const W* we = w2 + e * H * I;
    for (int64_t h = h0; h < h1; h += NR) {
      const int nr = int(std::min<int64_t>(NR, h1 - h));
      const W* wr[NR];
      for (int n = 0; n < nr; ++n) wr[n] = we + (h + n) * I;
      alignas(64) float buf[NR * WIDEN_K];
      const float* ptrs[NR];
      const float* const* wide = widen<W>(nr, wr, I, r1 - r0, buf, ptrs);
      for (int64_t r = r0; r < r1; r += MR) {
        const int mr = int(std::min<int64_t>(MR, r1 - r));
        const float* xr[MR];
        for (int m = 0; m < mr; ++m) xr[m] = s.act + (r + m) * I;
        float res[MR][NR];
        dot_rows_block<W>(mr, nr, xr, wr, I, res, wide);
        for (int m = 0; m < mr; ++m)
          for (int n = 0; n < nr; ++n) s.y[(r + m) * H + h + n] = res[m][n];
      }
    }
  });
  combine(a, t0, C, s);
}

// The quantized experts of pr_moe_quant: the GGUF type, layout (r8) and bytes per expert of a stack.
struct QuantStack {
  int qt;
  const uint8_t* w;
  bool r8;
  int64_t expert_bytes;
};

// Rows [r0, r1) (sorted positions) of x [.., ldx] times expert e's N rows of K weights -> y [.., ldy].
int quant_rows(const QuantStack& q, int isa, int64_t e, int64_t N, int64_t K, const float* x, int64_t ldx,
               int64_t r0, int64_t r1, float* y, int64_t ldy) {
  const auto fn = q.r8 ? pr_quant_linear8 : pr_quant_linear;
  return fn(q.qt, q.w + e * q.expert_bytes, N, K, x + r0 * ldx, ldx, 0, r1 - r0, y + r0 * ldy, ldy, 0, isa);
}

// The chunk's routed rows through the active experts' quantized gate and up, silu(gate) * up, down.
int experts_quant(const Args& a, const QuantStack& w1, const QuantStack& w3, const QuantStack& w2, int isa,
                  int64_t t0, int64_t C, const Scratch& s) {
  const int64_t H = a.H, I = a.I, E = a.E, P = C * a.k;
  run_items((P + 15) / 16, [&](int64_t i) {   // x rows in expert order, float32
    for (int64_t q = 16 * i; q < std::min(P, 16 * i + 16); ++q) {
      const char* row = static_cast<const char*>(a.x) + (t0 + s.tok[q]) * a.x_ts * (a.dtype ? 2 : 4);
      for (int64_t h = 0; h < H; ++h)
        s.xf[q * H + h] = a.dtype ? bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[h])
                                  : reinterpret_cast<const float*>(row)[h];
    }
  });
  for (int64_t e = 0; e < E; ++e)   // quantized linears per active expert (threads over its rows)
    if (s.start[e + 1] > s.start[e] &&
        (quant_rows(w1, isa, e, I, H, s.xf, H, s.start[e], s.start[e + 1], s.act, 2 * I) ||
         quant_rows(w3, isa, e, I, H, s.xf, H, s.start[e], s.start[e + 1], s.act + I, 2 * I)))
      return 2;
  run_items((P + 15) / 16, [&](int64_t i) {
    for (int64_t r = 16 * i; r < std::min(P, 16 * i + 16); ++r) {
      float* gu = s.act + r * 2 * I;
      for (int64_t c = 0; c < I; ++c) gu[c] = silu_mul(gu[c], gu[I + c]);
    }
  });
  for (int64_t e = 0; e < E; ++e)
    if (s.start[e + 1] > s.start[e] &&
        quant_rows(w2, isa, e, H, I, s.act, 2 * I, s.start[e], s.start[e + 1], s.y, H))
      return 2;
  combine(a, t0, C, s);
  return 0;
}

// A stack of E experts of N rows of K weights of type qt: its layout checked for path isa.
bool quant_stack(int qt, const void* w, int r8, int isa, int64_t N, int64_t K, QuantStack* out) {
  const int bytes = pr_quant_block_bytes(qt), size = bytes ? pr_quant_block_size(qt) : 0;
  if (!bytes || !pr_quant_isa_compiled(isa) || K % size || (r8 && (!pr_quant_r8_isa(qt, isa) || N % 8))) return false;
  *out = {qt, static_cast<const uint8_t*>(w), r8 != 0, r8 ? pr_quant_r8_bytes(qt, N, K) : N * (K / size) * bytes};
  return true;
}
}  // namespace

extern "C" {

// 1 when this build's MoE kernel uses AVX-512F (widening bfloat16 by shifts), 0 for plain loops.
int pr_moe_simd() {
#ifdef PR_MOE_AVX512
  return 1;
#else
  return 0;
#endif
}

// Bytes of scratch pr_moe needs for chunks of `chunk` tokens.
int64_t pr_moe_scratch_bytes(int64_t chunk, int64_t H, int64_t I, int64_t E, int64_t top_k) {
  return layout(chunk, H, I, E, top_k, nullptr, nullptr);
}

// out[t] (row stride o_ts) = sum_j weight[t, j] * expert_{id[t, j]}(x[t]) for t < T: see the top of
// this file. dtype 0: float32 x, w13, w2, out; 1: bfloat16. logits [T, E] (row stride l_ts) float32
// or (logits_bf16) bfloat16. scoring 0: softmax, 1: sigmoid. scratch: pr_moe_scratch_bytes(chunk,
// H, I, E, top_k) bytes. Returns 0, or 1 for unsupported arguments (H > 8192, E > 1024, bad top_k).
int pr_moe(int dtype, const void* x, int64_t x_ts, const void* logits, int64_t l_ts, int logits_bf16,
           const void* w13, const void* w2, void* out, int64_t o_ts, int64_t T, int64_t H, int64_t I, int64_t E,
           int64_t top_k, int renormalize, int scoring, void* scratch, int64_t chunk) {
  if (H < 1 || H > 8192 || I < 1 || E < 1 || E > 1024 || top_k < 1 || top_k > E || chunk < 1 || T < 0 ||
      (dtype != 0 && dtype != 1))
    return 1;
  const Args a{dtype, x, x_ts, logits, l_ts, logits_bf16, w13, w2, out, o_ts, H, I, E, top_k,
               renormalize != 0, scoring == 1};
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 63) / 64 * 64);
  Scratch s;
  layout(chunk, H, I, E, top_k, base, &s);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t C = std::min(chunk, T - t0);
    route(a, t0, C, s);
    if (dtype)
      experts<uint16_t>(a, t0, C, s);
    else
      experts<float>(a, t0, C, s);
  }
  return 0;
}

// Bytes of scratch pr_moe_quant needs for chunks of `chunk` tokens.
int64_t pr_moe_quant_scratch_bytes(int64_t chunk, int64_t H, int64_t I, int64_t E, int64_t top_k) {
  return layout(chunk, H, I, E, top_k, nullptr, nullptr, true);
}

// pr_moe with the experts in GGUF blocks (see the top of this file): x and out float32, or bfloat16
// when x_bf16; w1 (gate) and w3 (up) E experts' I rows of H weights of GGML type qt13, w2 (down) E
// experts' H rows of I weights of type qt2, each in the r8 layout when r8_13 / r8_2
// (pr_quant_repack8 of each expert's rows), run on instruction-set path isa (quant_gemm.cpp's
// numbering). scratch: pr_moe_quant_scratch_bytes(chunk, H, I, E, top_k) bytes. Returns 0; 1 for
// unsupported arguments (pr_moe's limits, a row stride below its row, a type or layout this build
// does not run on isa, H or I not a multiple of the type's block); 2 when a quantized linear failed.
int pr_moe_quant(int x_bf16, const void* x, int64_t x_ts, const void* logits, int64_t l_ts, int logits_bf16,
                 int qt13, const void* w1, const void* w3, int r8_13, int qt2, const void* w2, int r8_2, int isa,
                 void* out, int64_t o_ts, int64_t T, int64_t H, int64_t I, int64_t E, int64_t top_k,
                 int renormalize, int scoring, void* scratch, int64_t chunk) {
  QuantStack q1, q3, q2;
  if (H < 1 || H > 8192 || I < 1 || E < 1 || E > 1024 || top_k < 1 || top_k > E || chunk < 1 || T < 0 ||
      x_ts < H || o_ts < H || l_ts < E || (x_bf16 != 0 && x_bf16 != 1) ||
      !quant_stack(qt13, w1, r8_13, isa, I, H, &q1) || !quant_stack(qt13, w3, r8_13, isa, I, H, &q3) ||
      !quant_stack(qt2, w2, r8_2, isa, H, I, &q2))
    return 1;
  const Args a{x_bf16, x, x_ts, logits, l_ts, logits_bf16, nullptr, nullptr, out, o_ts, H, I, E, top_k,
               renormalize != 0, scoring == 1};
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch) + 63) / 64 * 64);
  Scratch s;
  layout(chunk, H, I, E, top_k, base, &s, true);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t C = std::min(chunk, T - t0);
    route(a, t0, C, s);
    const int rc = experts_quant(a, q1, q3, q2, isa, t0, C, s);
    if (rc) return rc;
  }
  return 0;
}
}
