// The AMX tile configuration every AMX-BF16 product of the kernel loads (attention's GEMM,
// bf16-packed's products, the LoRA products): palette 1, tiles 0-7 of 16 rows x 64 bytes
// (C tiles 0-3, A tiles 4-5, B tiles 6-7 in each of them). Plain data: the code that loads it
// (_tile_loadconfig) is compiled for amx-tile, per call, because oneDNN loads its own
// configuration on the same threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace kt_kernel {

// f(std::integral_constant<int, c>{}) for a run-time count 1 <= c <= Max: register blocks of
// c rows are templates, and their callers pick one at run time.
template <int Max, class F>
inline void with_rows(int64_t c, const F& f) {
  if constexpr (Max > 1) {
    if (c < Max) {
      with_rows<Max - 1>(c, f);
      return;
    }
  }
  f(std::integral_constant<int, Max>{});
}

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
// The first `count` of 16 lanes (none for count <= 0, all for count >= 16).
inline __mmask16 first_lanes(int64_t count) {
  if (count <= 0) return 0;
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

// C tiles 0-3 of a 32 x 32 block += [A rows 0-15; A rows 16-31] x [B columns 0-15, 16-31]: one
// step of 32 over the reduced dimension (row strides in bytes; a stride of 0 repeats one row,
// e.g. of a zero buffer). With I8, int8 tiles (TDPBSSD: 64 of the reduced dimension per step,
// int32 C).
template <bool I8 = false>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) inline void tile_step(
    const void* a0, int64_t sa0, const void* a1, int64_t sa1, const void* b0, const void* b1,
    int64_t sb) {
  _tile_loadd(4, a0, sa0);
  _tile_loadd(5, a1, sa1);
  _tile_loadd(6, b0, sb);
  _tile_loadd(7, b1, sb);
  if constexpr (I8) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  } else {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// C tiles 0-1 += A rows 0-15 x [B columns 0-15, 16-31]: tile_step for a last row tile of 16
// rows, which would otherwise multiply a tile of padding zeros.
template <bool I8 = false>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) inline void tile_step_half(
    const void* a0, int64_t sa0, const void* b0, const void* b1, int64_t sb) {
  _tile_loadd(4, a0, sa0);
  _tile_loadd(6, b0, sb);
  _tile_loadd(7, b1, sb);
  if constexpr (I8) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
  } else {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
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
  const __mmask16 mask[2] = {first_lanes(n - c0), first_lanes(n - c0 - 16)};
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

// Per 8 bytes (a b c d, 16 bits each; in the packed layouts a 2x2 tile: rows n, n + 1 at
// column k, then at k + 1) -> a c b d: rows' column pairs (W[n, k], W[n, k + 1]), (W[n + 1,
// k], W[n + 1, k + 1]).
__attribute__((target("avx512f,avx512bw"))) inline __m512i to_rows() {
  return _mm512_set4_epi32(0x0f0e0b0a, 0x0d0c0908, 0x07060302, 0x05040100);
}

// t row g (64 bytes, rows 32 bf16 apart), qword i = v[i] qword g: an 8 x 8 qword transpose.
__attribute__((target("avx512f"))) inline void transpose8_qwords(const __m512i (&v)[8],
                                                                 uint16_t* t) {
  __m512i u[8];
  for (int i = 0; i < 4; ++i) {
    u[2 * i] = _mm512_unpacklo_epi64(v[2 * i], v[2 * i + 1]);
    u[2 * i + 1] = _mm512_unpackhi_epi64(v[2 * i], v[2 * i + 1]);
  }
  // u[2i] lane L: qwords 2L of v[2i], v[2i+1]; u[2i+1]: qwords 2L+1.
  for (int h = 0; h < 2; ++h) {
    const __m512i a0 = _mm512_shuffle_i64x2(u[h], u[2 + h], 0x88);
    const __m512i a1 = _mm512_shuffle_i64x2(u[4 + h], u[6 + h], 0x88);
    const __m512i b0 = _mm512_shuffle_i64x2(u[h], u[2 + h], 0xDD);
    const __m512i b1 = _mm512_shuffle_i64x2(u[4 + h], u[6 + h], 0xDD);
    // rows h, 4 + h from a0/a1 (lanes 0 and 2), rows 2 + h, 6 + h from b0/b1 (lanes 1 and 3)
    _mm512_storeu_si512(t + 32 * h, _mm512_shuffle_i64x2(a0, a1, 0x88));
    _mm512_storeu_si512(t + 32 * (4 + h), _mm512_shuffle_i64x2(a0, a1, 0xDD));
    _mm512_storeu_si512(t + 32 * (2 + h), _mm512_shuffle_i64x2(b0, b1, 0x88));
    _mm512_storeu_si512(t + 32 * (6 + h), _mm512_shuffle_i64x2(b0, b1, 0xDD));
  }
}

// Plain SSE and C++, outside the AMX target below, so that the AVX-512 products inline them too.
constexpr int64_t kTile = 512;  // bf16 elements of one tile

// The 16 lines (1 KiB) from p, to L1 when near, else to L2.
inline void prefetch_kib(const void* p, bool near) {
  const char* c = static_cast<const char*>(p);
  if (near) {
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) _mm_prefetch(c + 64 * l, _MM_HINT_T0);
  } else {
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) _mm_prefetch(c + 64 * l, _MM_HINT_T1);
  }
}

// This thread's buffer for one pass's B tiles (`steps` pairs), 64-byte aligned for the
// aligned stores that build them; reused by the next call.
inline uint16_t* pass_buffer(int64_t steps) {
  thread_local std::vector<uint16_t> buf;
  buf.resize(static_cast<size_t>(steps * 2 * kTile) + 32);
  return buf.data() + (32 - reinterpret_cast<uintptr_t>(buf.data()) / 2 % 32) % 32;
}
#endif

// Shared by the AMX products of the weight formats (format_bf16_packed.cpp; int8_packed and
// int4_packed through amx_packed_ints.h) and the LoRA products.
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
// The 16 x 16 dwords r[l][j] -> r[j][l] (rows become the columns), in place.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4 g + c], 128-bit lane L: rows 4 g .. 4 g + 3 at column 4 L + c
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
    const __m512i b = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i a2 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i b2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(a, b, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(a, b, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(a2, b2, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(a2, b2, 0xDD);
  }
}

// How many tile steps ahead the first row tile prefetches the weights (a step reads 2 KiB).
constexpr int64_t kAhead = 6;

// One pass: every row tile of a (rows x ld, padded) against `steps` pairs of B tiles, the pair
// for outputs c0 .. c0 + 31 of step s at bt + 2 s kTile. The first row tile builds step s's
// pair (`build(s, dst)`) just before its tile products, so the weights stream from DRAM while
// the tiles multiply; later row tiles reuse the pairs from L2.
// `fetch(ahead, t, near)` prefetches the weights of step t of this pass (ahead 0) or the next
// (ahead 1), to L1 when near, else to L2. The first row tile asks kAhead steps ahead (running
// into the next pass when it is the only one); the last of several row tiles asks for the
// next pass's steps, as it builds none of its own.
// Why: at 16-64 rows the products are bound by the weights' DRAM reads (one core reads 13 GB/s
// here). Building all of a pass's pairs before its first row tile left DRAM idle while the
// tiles multiplied, and the products streamed 7-9 GB/s at 16-32 rows; this way, 9.5-13
// (benchmarks/results/history.md, "bf16-packed streams its weights").
// pass_tiles_to hands row tile m0's 4 C tiles (16 x 16 each: fp32, or int32 bits with I8) to
// `store(c, m0)`; pass_tiles rounds them into bf16 `out`. With I8 the steps run on int8 tiles:
// a step is 64 of the reduced dimension, and `a` holds int8 rows addressed as bf16 pairs (ld
// in units of 2 bytes).
template <bool I8, class Build, class Fetch, class Store>
void pass_tiles_to(const uint16_t* a, int64_t ld, int64_t rows, int64_t m, uint16_t* bt,
                   int64_t steps, const Build& build, const Fetch& fetch, const Store& store) {
  alignas(64) float c[4][256];
  // A last row tile of at most 16 rows takes one A tile: padding it to 32 rows multiplied 11%
  // zeros on average at 100-150 rows per expert (T=2048, E=128), 40% at 17-45 (T=512).
  const bool half = (m + 15) / 16 % 2 == 1;
  const auto step = [&](const uint16_t* a0, const uint16_t* b, bool h) {
    if (h) {
      tile_step_half<I8>(a0, ld * 2, b, b + kTile, 64);
    } else {
      tile_step<I8>(a0, ld * 2, a0 + 16 * ld, ld * 2, b, b + kTile, 64);
    }
  };
  if (rows == 32) {  // one row tile reuses no pair: each is built in L1 and used at once
    alignas(64) uint16_t one[2 * kTile];
    tiles_zero();
    for (int64_t s = 0; s < steps; ++s) {
      if (s + kAhead < steps) {
        fetch(0, s + kAhead, true);
      } else {
        fetch(1, s + kAhead - steps, true);
      }
      build(s, one);
      step(a + 32 * s, one, half);
    }
    tiles_store(c);
    store(c, int64_t{0});
    return;
  }
  for (int64_t m0 = 0; m0 < rows; m0 += 32) {
    const bool first = m0 == 0, last = m0 + 32 >= rows;
    const bool h = last && half;
    tiles_zero();
    const uint16_t* a0 = a + m0 * ld;
    for (int64_t s = 0; s < steps; ++s) {
      uint16_t* b = bt + 2 * s * kTile;
      if (first) {
        if (s + kAhead < steps) fetch(0, s + kAhead, true);
        build(s, b);
      } else if (last) {
        fetch(1, s, false);
      }
      step(a0 + 32 * s, b, h);
    }
    tiles_store(c);
    store(c, m0);
  }
}

template <class Build, class Fetch>
void pass_tiles(const uint16_t* a, int64_t ld, int64_t rows, int64_t m, uint16_t* bt,
                int64_t steps, int64_t c0, int64_t n, uint16_t* out, int64_t ldo,
                const Build& build, const Fetch& fetch) {
  pass_tiles_to<false>(a, ld, rows, m, bt, steps, build, fetch,
                       [&](const float (&c)[4][256], int64_t m0) {
                         store_c_tiles<false>(c, m0, m, c0, n, out, ldo, 1.0f);
                       });
}

#pragma GCC pop_options
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
