// CPU graphs: replay a recorded decode step (kernel_calls.py, graphs.py) without Python.
//
// A record is 1 + 26 int64 words: the kernel id (its position in kernel_calls.REPLAYABLE,
// from 1) and its arguments in order: pointers and integers as they are, C `float`s as the
// bits of a double. Every kernel's own prototype is spelled out below: a call casts each
// word back to its parameter's type (no ABI tricks). pr_replay stops at the first kernel
// that reports an error and returns 1 + its index (0: all ran).

#include <chrono>
#include <cstdint>
#include <cstring>

extern "C" {
int pr_quant_linear(int qt, const uint8_t* w, int64_t N, int64_t K, const void* x, int64_t ldx, int x_bf16,
                    int64_t M, void* y, int64_t ldy, int y_bf16, int isa);
int pr_quant_linear8(int qt, const uint8_t* w8, int64_t N, int64_t K, const void* x, int64_t ldx, int x_bf16,
                     int64_t M, void* y, int64_t ldy, int y_bf16, int isa);
int pr_dpbf16_linear_bf16(const uint16_t* x, int64_t x_ts, const uint16_t* wp, uint16_t* y, int64_t y_ts,
                          int64_t M, int64_t N, int64_t K);
int pr_amx_linear_bf16(const uint16_t* x, int64_t x_ts, const uint16_t* wp, uint16_t* y, int64_t y_ts,
                       int64_t M, int64_t N, int64_t K);
int pr_rms_norm(int dtype, const void* x, int64_t x_ts, const void* w, void* out, int64_t o_ts, int64_t T, int64_t H,
                float eps);
int pr_add_rms_norm(int dtype, const void* x, const void* res, const void* w, void* r_out, void* out, int64_t T,
                    int64_t H, float eps);
int pr_silu_mul(int dtype, const void* gu, int64_t g_ts, void* out, int64_t o_ts, int64_t T, int64_t I);
int pr_rotary(int dtype, void* q, int64_t q_ts, int64_t Hq, void* k, int64_t k_ts, int64_t Hk, const int64_t* pos,
              const float* cos, const float* sin, int64_t T, int64_t D);
int pr_paged_attention(int dtype, void* q, int64_t q_ts, void* k, int64_t k_ts, void* v, int64_t v_ts,
                       void* cache, int64_t NB, int64_t bs, int64_t Hq, int64_t Hkv, int64_t D,
                       const int64_t* slots, int64_t num_write, const int32_t* qsl, const int32_t* seq_lens,
                       const int32_t* bt, int64_t bt_stride, void* out, int64_t o_ts, int64_t r_begin,
                       int64_t r_end, float scale, int64_t window, float softcap);
int pr_moe(int dtype, const void* x, int64_t x_ts, const void* logits, int64_t l_ts, int logits_bf16,
           const void* w13, const void* w2, void* out, int64_t o_ts, int64_t T, int64_t H, int64_t I, int64_t E,
           int64_t top_k, int renormalize, int scoring, void* scratch, int64_t chunk);
int pr_avx512_linear_bf16(const void* x, int64_t x_ts, int x_f32, const uint16_t* wp, uint16_t* y, int64_t y_ts,
                          int64_t M, int64_t N, int64_t K);
int pr_lora(int dtype, const void* x, int64_t x_ts, void* y, int64_t y_ts, const int32_t* token_lora,
            const void* lora_a, const void* lora_b, const int64_t* bounds, int64_t T, int64_t in, int64_t out,
            int64_t L, int64_t S, int64_t R, void* scratch, int64_t chunk);
int pr_lora_embed(int dtype, const int64_t* ids, void* y, int64_t y_ts, const int32_t* token_lora, const void* lora_a,
                  const void* lora_b, int64_t T, int64_t V, int64_t H, int64_t L, int64_t R);
int pr_quant_rows(int qt, const uint8_t* w, int r8, int64_t N, int64_t K, const int64_t* ids, int64_t n, void* out,
                  int64_t o_ts, int out_bf16);
int pr_moe_quant(int x_bf16, const void* x, int64_t x_ts, const void* logits, int64_t l_ts, int logits_bf16,
                 int qt13, const void* w1, const void* w3, int r8_13, int qt2, const void* w2, int r8_2, int isa,
                 void* out, int64_t o_ts, int64_t T, int64_t H, int64_t I, int64_t E, int64_t top_k,
                 int renormalize, int scoring, void* scratch, int64_t chunk);

// dst[i] = src[idx[i]] for rows of row_bytes bytes (an embedding lookup).
void pr_gather_rows(const uint8_t* src, int64_t row_bytes, const int64_t* idx, int64_t n, uint8_t* dst) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * row_bytes, src + idx[i] * row_bytes, row_bytes);
}
}

namespace {

enum Kernel {  // kernel_calls.REPLAYABLE, in order
  QUANT_LINEAR = 1, QUANT_LINEAR8, DPBF16_LINEAR, AMX_LINEAR, RMS_NORM, ADD_RMS_NORM, SILU_MUL, ROTARY,
  PAGED_ATTENTION, GATHER_ROWS, MOE, AVX512_LINEAR, LORA, LORA_EMBED, QUANT_ROWS, MOE_QUANT, NUM_KERNELS
};
const char* const NAMES[] = {"", "pr_quant_linear", "pr_quant_linear8", "pr_dpbf16_linear_bf16",
                             "pr_amx_linear_bf16", "pr_rms_norm", "pr_add_rms_norm",
                             "pr_silu_mul", "pr_rotary", "pr_paged_attention", "pr_gather_rows", "pr_moe",
                             "pr_avx512_linear_bf16", "pr_lora", "pr_lora_embed", "pr_quant_rows", "pr_moe_quant"};
constexpr int64_t WORDS = 27;

template <typename T>
T* p(int64_t w) { return reinterpret_cast<T*>(static_cast<intptr_t>(w)); }

float f(int64_t w) {
  double d;
  std::memcpy(&d, &w, sizeof d);
  return static_cast<float>(d);
}

int run(const int64_t* r) {
  const int64_t* a = r + 1;
  switch (r[0]) {
    case QUANT_LINEAR:
    case QUANT_LINEAR8:
      return (r[0] == QUANT_LINEAR ? pr_quant_linear : pr_quant_linear8)(
          int(a[0]), p<const uint8_t>(a[1]), a[2], a[3], p<const void>(a[4]), a[5], int(a[6]), a[7],
          p<void>(a[8]), a[9], int(a[10]), int(a[11]));
    case DPBF16_LINEAR:
    case AMX_LINEAR:
      return (r[0] == DPBF16_LINEAR ? pr_dpbf16_linear_bf16 : pr_amx_linear_bf16)(
          p<const uint16_t>(a[0]), a[1], p<const uint16_t>(a[2]), p<uint16_t>(a[3]), a[4], a[5], a[6], a[7]);
    case RMS_NORM:
      return pr_rms_norm(int(a[0]), p<const void>(a[1]), a[2], p<const void>(a[3]), p<void>(a[4]), a[5], a[6], a[7],
                         f(a[8]));
    case ADD_RMS_NORM:
      return pr_add_rms_norm(int(a[0]), p<const void>(a[1]), p<const void>(a[2]), p<const void>(a[3]),
                             p<void>(a[4]), p<void>(a[5]), a[6], a[7], f(a[8]));
    case SILU_MUL:
      return pr_silu_mul(int(a[0]), p<const void>(a[1]), a[2], p<void>(a[3]), a[4], a[5], a[6]);
    case ROTARY:
      return pr_rotary(int(a[0]), p<void>(a[1]), a[2], a[3], p<void>(a[4]), a[5], a[6], p<const int64_t>(a[7]),
                       p<const float>(a[8]), p<const float>(a[9]), a[10], a[11]);
    case PAGED_ATTENTION:
      return pr_paged_attention(int(a[0]), p<void>(a[1]), a[2], p<void>(a[3]), a[4], p<void>(a[5]), a[6],
                                p<void>(a[7]), a[8], a[9], a[10], a[11], a[12], p<const int64_t>(a[13]), a[14],
                                p<const int32_t>(a[15]), p<const int32_t>(a[16]), p<const int32_t>(a[17]), a[18],
                                p<void>(a[19]), a[20], a[21], a[22], f(a[23]), a[24], f(a[25]));
    case GATHER_ROWS:
      pr_gather_rows(p<const uint8_t>(a[0]), a[1], p<const int64_t>(a[2]), a[3], p<uint8_t>(a[4]));
      return 0;
    case MOE:
      return pr_moe(int(a[0]), p<const void>(a[1]), a[2], p<const void>(a[3]), a[4], int(a[5]), p<const void>(a[6]),
                    p<const void>(a[7]), p<void>(a[8]), a[9], a[10], a[11], a[12], a[13], a[14], int(a[15]),
                    int(a[16]), p<void>(a[17]), a[18]);
    case AVX512_LINEAR:
      return pr_avx512_linear_bf16(p<const void>(a[0]), a[1], int(a[2]), p<const uint16_t>(a[3]), p<uint16_t>(a[4]),
                                   a[5], a[6], a[7], a[8]);
    case LORA:
      return pr_lora(int(a[0]), p<const void>(a[1]), a[2], p<void>(a[3]), a[4], p<const int32_t>(a[5]),
                     p<const void>(a[6]), p<const void>(a[7]), p<const int64_t>(a[8]), a[9], a[10], a[11], a[12],
                     a[13], a[14], p<void>(a[15]), a[16]);
    case LORA_EMBED:
      return pr_lora_embed(int(a[0]), p<const int64_t>(a[1]), p<void>(a[2]), a[3], p<const int32_t>(a[4]),
                           p<const void>(a[5]), p<const void>(a[6]), a[7], a[8], a[9], a[10], a[11]);
    case QUANT_ROWS:
      return pr_quant_rows(int(a[0]), p<const uint8_t>(a[1]), int(a[2]), a[3], a[4], p<const int64_t>(a[5]), a[6],
                           p<void>(a[7]), a[8], int(a[9]));
    case MOE_QUANT:
      return pr_moe_quant(int(a[0]), p<const void>(a[1]), a[2], p<const void>(a[3]), a[4], int(a[5]), int(a[6]),
                          p<const void>(a[7]), p<const void>(a[8]), int(a[9]), int(a[10]), p<const void>(a[11]),
                          int(a[12]), int(a[13]), p<void>(a[14]), a[15], a[16], a[17], a[18], a[19], a[20],
                          int(a[21]), int(a[22]), p<void>(a[23]), a[24]);
  }
  return -1;  // unknown kernel id
}

}  // namespace

extern "C" {

// The name of kernel id `kind` ("" when unknown): Python checks its REPLAYABLE against these.
const char* pr_replay_kernel_name(int kind) { return kind > 0 && kind < NUM_KERNELS ? NAMES[kind] : ""; }

// Run n records (WORDS int64 each) in order; 0, or 1 + the index of the first that failed.
int64_t pr_replay(const int64_t* records, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (run(records + i * WORDS) != 0) return i + 1;
  return 0;
}

// pr_replay that also adds each record's wall time in nanoseconds to ns[i] (a profile).
int64_t pr_replay_timed(const int64_t* records, int64_t n, int64_t* ns) {
  using clock = std::chrono::steady_clock;
  for (int64_t i = 0; i < n; ++i) {
    auto start = clock::now();
    if (run(records + i * WORDS) != 0) return i + 1;
    ns[i] += std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start).count();
  }
  return 0;
}
}
