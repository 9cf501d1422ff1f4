// Where the pool's bfloat16 linears (linear_bf16.cpp, linear_avx512.cpp) prefetch the weights
// they stream: into L1 (`prefetcht0`) or L2 (`prefetcht1`). Which is faster is the core's
// business, so `linear_prefetch.py` times both once per machine and sets the faster with
// pr_set_linear_prefetch; a call reads the level once.
#pragma once
#include <atomic>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pr {
inline std::atomic<int> weight_prefetch_l2{0};   // 0: L1, 1: L2

inline bool weight_prefetch_to_l2() { return weight_prefetch_l2.load(std::memory_order_relaxed) != 0; }

#if defined(__x86_64__) || defined(__i386__)
// The `lines` cache lines from p on, into L2 (L2) or L1.
template <bool L2, int lines>
inline void prefetch_lines(const void* p) {
  for (int i = 0; i < lines; ++i) _mm_prefetch(static_cast<const char*>(p) + 64 * i, L2 ? _MM_HINT_T1 : _MM_HINT_T0);
}
#endif
}  // namespace pr
