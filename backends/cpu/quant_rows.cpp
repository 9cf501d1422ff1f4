// Rows of a GGUF-quantized matrix by index, dequantised: the quantized token embedding's lookup
// (quant_embedding.py), so the embedding stays in its blocks and a step decodes only its tokens' rows.
//
// W is N rows of K weights of GGML type qt, either in the GGUF layout (rows of blocks, as in the file)
// or, with r8, in the row-interleaved copy `pr_quant_repack8` makes (quant_gemm.cpp), which a tied
// embedding shares with the LM head that runs it. Each id's row (GGUF layout) or its group of 8 rows
// (r8: the row's group, then row id % 8 of it) goes through `pr_quant_dequantize` /
// `pr_quant_dequantize8`, so the values are theirs bit for bit: what the model's dequantised
// weights hold for the same blocks. The rows run in order on the calling thread (a lookup is one
// row per token: a decode step's few, a prefill chunk's hundreds; the per-row work is K weights).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
int pr_quant_block_bytes(int qt);
int pr_quant_block_size(int qt);
int pr_quant_r8_supported(int qt);
int64_t pr_quant_r8_bytes(int qt, int64_t N, int64_t K);
int pr_quant_dequantize(int qt, const uint8_t* w, int64_t N, int64_t K, void* out, int out_bf16);
int pr_quant_dequantize8(int qt, const uint8_t* w8, int64_t N, int64_t K, void* out, int out_bf16);

// out[i] (row stride o_ts elements; float32, or bfloat16 when out_bf16) = row ids[i] of W for i < n
// (layout above; r8: N % 8 == 0). Returns 0; 1 for a type this build does not run (or has no r8
// layout for), 2 when K is not a multiple of the type's block (or N % 8 with r8, n < 0, o_ts < K), 3 for an id
// outside [0, N) (the rows before it are written).
int pr_quant_rows(int qt, const uint8_t* w, int r8, int64_t N, int64_t K, const int64_t* ids, int64_t n, void* out,
                  int64_t o_ts, int out_bf16) {
  const int bytes = pr_quant_block_bytes(qt), size = pr_quant_block_size(qt);
  if (!bytes || (r8 && !pr_quant_r8_supported(qt))) return 1;
  if (K % size || (r8 && N % 8) || n < 0 || o_ts < K) return 2;
  const int64_t es = out_bf16 ? 2 : 4, row_bytes = K / size * bytes;
  const int64_t group_bytes = r8 ? pr_quant_r8_bytes(qt, 8, K) : 0;
  thread_local std::vector<uint8_t> group;   // r8: one group of 8 dequantised rows, grown once
  if (r8) group.resize(std::max<size_t>(group.size(), size_t(8 * K * es)));
  int64_t decoded = -1;   // the group `group` holds (consecutive ids of one group decode it once)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= N) return 3;
    char* dst = static_cast<char*>(out) + i * o_ts * es;
    if (!r8) {
      const int rc = pr_quant_dequantize(qt, w + id * row_bytes, 1, K, dst, out_bf16);
      if (rc) return rc;
      continue;
    }
    if (id / 8 != decoded) {
      const int rc = pr_quant_dequantize8(qt, w + id / 8 * group_bytes, 8, K, group.data(), out_bf16);
      if (rc) return rc;
      decoded = id / 8;
    }
    std::memcpy(dst, group.data() + id % 8 * K * es, size_t(K * es));
  }
  return 0;
}
}
