// The AMX tile configuration every AMX-BF16 product of the kernel loads (attention's GEMM,
// bf16-packed's products, the LoRA products): palette 1, tiles 0-7 of 16 rows x 64 bytes
// (C tiles 0-3, A tiles 4-5, B tiles 6-7 in each of them). Plain data: the code that loads it
// (_tile_loadconfig) is compiled for amx-tile, per call, because oneDNN loads its own
// configuration on the same threads.
#pragma once

#include <cstdint>

namespace kt_kernel {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline const TileConfig& tile_config_16x64() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  return cfg;
}

}  // namespace kt_kernel
