// The AMX tile configuration every AMX-BF16 product of the kernel loads (attention's GEMM,
// bf16-packed's products, the LoRA products): palette 1, tiles 0-7 of 16 rows x 64 bytes
// (C tiles 0-3, A tiles 4-5, B tiles 6-7 in each of them). Plain data: the code that loads it
// (_tile_loadconfig) is compiled for amx-tile, per call, because oneDNN loads its own
// configuration on the same threads.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

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

#if defined(__x86_64__) && defined(__GNUC__)
// C tiles 0-3 of a 32 x 32 block += [A rows 0-15; A rows 16-31] x [B columns 0-15, 16-31]: one
// step of 32 over the reduced dimension (row strides in bytes; a stride of 0 repeats one row,
// e.g. of a zero buffer).
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_step(const void* a0, int64_t sa0,
                                                                    const void* a1, int64_t sa1,
                                                                    const void* b0, const void* b1,
                                                                    int64_t sb) {
  _tile_loadd(4, a0, sa0);
  _tile_loadd(5, a1, sa1);
  _tile_loadd(6, b0, sb);
  _tile_loadd(7, b1, sb);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

__attribute__((target("amx-tile"))) inline void tiles_zero() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// C tiles 0-3 to c[t] (16 x 16 fp32 each).
__attribute__((target("amx-tile"))) inline void tiles_store(float (&c)[4][256]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
}
#endif

}  // namespace kt_kernel
