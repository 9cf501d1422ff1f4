// The register-blocked micro-kernel of a pool linear (linear_bf16.cpp, linear_avx512.cpp) for a
// call's row block (1..6 rows), column blocks (1..4) and weight prefetch level (weight_prefetch.h):
// K<MR, NC, L2>::fn, each kernel's instantiations of its `micro` template. K must be named apart in
// each kernel (not only by an anonymous namespace: GCC mangles those alike, and the linker then kept
// one kernel's pick_micro instantiations for both).
#pragma once

namespace pr {
template <template <int, int, bool> class K, int NC, bool L2>
auto pick_micro_rows(int mr) {
  switch (mr) {
    case 1: return K<1, NC, L2>::fn;
    case 2: return K<2, NC, L2>::fn;
    case 3: return K<3, NC, L2>::fn;
    case 4: return K<4, NC, L2>::fn;
    case 5: return K<5, NC, L2>::fn;
    default: return K<6, NC, L2>::fn;
  }
}

template <template <int, int, bool> class K, bool L2>
auto pick_micro_cols(int mr, int nc) {
  switch (nc) {
    case 1: return pick_micro_rows<K, 1, L2>(mr);
    case 2: return pick_micro_rows<K, 2, L2>(mr);
    case 3: return pick_micro_rows<K, 3, L2>(mr);
    default: return pick_micro_rows<K, 4, L2>(mr);
  }
}

template <template <int, int, bool> class K>
auto pick_micro(int mr, int nc, bool l2) {
  return l2 ? pick_micro_cols<K, true>(mr, nc) : pick_micro_cols<K, false>(mr, nc);
}
}  // namespace pr
