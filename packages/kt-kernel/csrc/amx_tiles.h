// The AMX tile configuration every AMX-BF16 product of the kernel loads (attention's GEMM,
// bf16-packed's products, the LoRA products): palette 1, tiles 0-7 of 16 rows x 64 bytes
// (C tiles 0-3, A tiles 4-5, B tiles 6-7 in each of them). Plain data: the code that loads it
// (_tile_loadconfig) is compiled for amx-tile, per call, because oneDNN loads its own
// configuration on the same threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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

// C tiles 0-1 += A rows 0-15 x [B columns 0-15, 16-31]: tile_step for a last row tile of 16
// rows, which would otherwise multiply a tile of padding zeros.
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_step_half(const void* a0,
                                                                         int64_t sa0,
                                                                         const void* b0,
                                                                         const void* b1,
                                                                         int64_t sb) {
  _tile_loadd(4, a0, sa0);
  _tile_loadd(6, b0, sb);
  _tile_loadd(7, b1, sb);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
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

// c (tiles_store of the block at rows m0, outputs c0) into bf16 out [m, n]: rows and outputs
// past m and n are dropped; with Acc, out = out + s * c, rounded once. Both 16-output halves of
// a row go out together: they share a 64-byte line, which at a row stride of 4 KiB was evicted
// by the other 15 rows' lines before the second half came to it.
template <bool Acc>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void store_c_tiles(
    const float (&c)[4][256], int64_t m0, int64_t m, int64_t c0, int64_t n, uint16_t* out,
    int64_t ldo, float s) {
  const __m512 sv = _mm512_set1_ps(s);
  __mmask16 mask[2];
  for (int j = 0; j < 2; ++j) {
    const int64_t cols = std::min<int64_t>(16, n - c0 - 16 * j);
    mask[j] = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (cols <= 0 ? 0 : (1u << cols) - 1));
  }
  for (int i = 0; i < 2; ++i) {
    for (int r = 0; r < 16 && m0 + 16 * i + r < m; ++r) {
      for (int j = 0; j < 2; ++j) {
        if (mask[j] == 0) continue;
        uint16_t* o = out + (m0 + 16 * i + r) * ldo + c0 + 16 * j;
        __m512 v = _mm512_load_ps(c[2 * i + j] + 16 * r);
        if constexpr (Acc) {
          const __m256i old = _mm256_maskz_loadu_epi16(mask[j], o);
          v = _mm512_fmadd_ps(
              v, sv, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)));
        }
        _mm256_mask_storeu_epi16(o, mask[j], (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}
#endif

// `in` [m, cols] (row stride ldi) copied to a zero-padded [rows, ld] buffer of this thread,
// rows = ceil32(m), ld = ceil32(cols) + 32 (the extra 64 bytes keep rows off 4 KiB
// multiples), so that every A tile is whole. The buffer is reused by the next call.
inline const uint16_t* padded_rows(const uint16_t* in, int64_t ldi, int64_t m, int64_t cols,
                                   int64_t& ld, int64_t& rows) {
  thread_local std::vector<uint16_t> buf;
  ld = (cols + 31) / 32 * 32 + 32;
  rows = (m + 31) / 32 * 32;
  buf.resize(static_cast<size_t>(rows * ld));
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* d = buf.data() + r * ld;
    const int64_t done = r < m ? cols : 0;
    if (r < m) std::memcpy(d, in + r * ldi, static_cast<size_t>(cols) * 2);
    std::fill(d + done, d + ld, uint16_t{0});
  }
  return buf.data();
}

}  // namespace kt_kernel
