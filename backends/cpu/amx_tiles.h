// AMX tile configuration shared by the AMX kernels (linear_amx.cpp, prefill_attention.cpp):
// palette 1 with all eight tiles 16 rows x 64 bytes. Include where __AMX_TILE__ is defined; a
// kernel loads it on each thread before its tile instructions and releases the tiles after.
#pragma once
#include <cstdint>
#include <immintrin.h>

namespace pr {
inline void configure_tiles_16x64() {
  alignas(64) uint8_t cfg[64] = {0};
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    cfg[16 + 2 * t] = 64;  // bytes per row
    cfg[48 + t] = 16;      // rows
  }
  _tile_loadconfig(cfg);
}
}  // namespace pr
