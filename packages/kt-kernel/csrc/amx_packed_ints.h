// The AMX products of the integer packed formats (format_int8_packed.cpp,
// format_int4_packed.cpp), over one layout of blocks:
//
// Block b of an expert's W [N, K] holds output rows 16b .. 16b + 15; for each column pair
// p < Ps (Ps = ceil(K/2) rounded up to 16) it stores the 16 rows' pairs (W[16b + l, 2p],
// W[16b + l, 2p + 1]) as one "pair row" of kPairBytes bytes, pair rows in order of p, then 64
// bytes of padding that keep the blocks' stride off multiples of 4 KiB. A format says how its
// pair row encodes the 32 integers (a Codec) and where each block's scales lie; the loops are
// the same:
// - x W^T: row p of a B tile is the block's pair row at p, widened, scaled and rounded to 16
//   bf16 pairs, as AMX wants them, with no transpose; a tile step reads 16 pair rows
//   (16 kPairBytes contiguous bytes) of each of two blocks.
// - dy W: 8 pair rows, shuffled to row pairs (to_rows) and transposed as qwords, give 8 rows
//   of W's row pairs for 16 columns.
// A Codec C provides:
//   static constexpr int64_t kPairBytes;            // bytes per pair row
//   int64_t n, k;                                   // the logical W is [n, k]
//   const uint8_t* block(int64_t b) const;          // block b's first byte
//   Scales scales(int64_t b, int64_t p) const;      // block b's scales for pair rows p..p+15
//   __m512i row(const uint8_t* r, const Scales&) const;  // a pair row as 16 bf16 pairs
// where each weight is its integer value times its fp32 scale, rounded once to bf16: the
// formats' Python dequantize, bitwise.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "formats.h"

namespace kt_kernel {
namespace formats {
namespace amx_ints {

constexpr int64_t kRows = 16;      // output rows per block
constexpr int64_t kPadBytes = 64;  // ending each block

// Ps: the pair rows per block, whole tile steps of 16.
inline int64_t stride_pairs(int64_t k) { return ceil_div(ceil_div(k, 2), 16) * 16; }

// Element i of a scalar tile loader's `out`: v rounded once to bf16 (nearest even), or v.
inline void put_weight(c10::ScalarType out_dtype, void* out, int64_t i, float v) {
  if (out_dtype == at::kBFloat16) {
    static_cast<uint16_t*>(out)[i] = c10::BFloat16(v).x;
  } else {
    static_cast<float*>(out)[i] = v;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

// A block's 16 row scales per lane of a widened pair row: lanes 2l, 2l + 1 hold row l's
// scale, rows 0-7 in lo and 8-15 in hi.
struct Scales {
  __m512 lo, hi;
};

inline Scales spread_scales(__m512 s) {
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  return {_mm512_permutexvar_ps(lo, s), _mm512_permutexvar_ps(hi, s)};
}

// 32 int8 values (16 rows' pairs, in order) as 16 bf16 pairs: value * scale in fp32, rounded
// once.
inline __m512i widen(__m256i b, const Scales& s) {
  const __m512 lo = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))), s.lo);
  const __m512 hi = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))), s.hi);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// The `Lines` lines from p, to L1 when near, else to L2.
template <int Lines>
inline void prefetch_lines(const uint8_t* p, bool near) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int l = 0; l < Lines; ++l) _mm_prefetch(c + 64 * l, near ? _MM_HINT_T0 : _MM_HINT_T1);
}

template <class C>
void nt(const C& w, const uint16_t* x_in, int64_t ldx, int64_t m, uint16_t* out, int64_t ldo) {
  constexpr int64_t kStep = 16 * C::kPairBytes;  // one block's bytes per tile step
  const int64_t blocks = ceil_div(w.n, kRows), steps = ceil_div(w.k, 32);
  int64_t ld = 0, rows = 0;
  const uint16_t* x = padded_rows(x_in, ldx, m, w.k, ld, rows);
  uint16_t* bt0 = pass_buffer(steps);
  _tile_loadconfig(&tile_config_16x64());  // per call: oneDNN loads its own on this thread
  for (int64_t b = 0; b < blocks; b += 2) {
    // B tile j of step s: row r is block b + j's pair row 16 s + r, widened.
    const auto build = [&](int64_t s, uint16_t* dst) {
      for (int j = 0; j < 2; ++j) {
        uint16_t* t = dst + j * kTile;
        if (b + j >= blocks) {
          std::fill(t, t + kTile, uint16_t{0});
          continue;
        }
        const uint8_t* src = w.block(b + j) + kStep * s;
        const auto sc = w.scales(b + j, 16 * s);
        for (int r = 0; r < 16; ++r) {
          _mm512_store_si512(t + 32 * r, w.row(src + C::kPairBytes * r, sc));
        }
      }
    };
    // Step t reads kStep bytes of each of the pass's two blocks.
    const auto fetch = [&](int64_t ahead, int64_t t, bool near) {
      for (int64_t j = 2 * ahead; j < 2 * ahead + 2 && b + j < blocks; ++j) {
        prefetch_lines<kStep / 64>(w.block(b + j) + kStep * t, near);
      }
    };
    pass_tiles(x, ld, rows, m, bt0, steps, b * kRows, w.n, out, ldo, build, fetch);
  }
  _tile_release();
}

// dy W block pair by block pair, for at most kBlockMajorRows rows: for kS steps s at a time
// (W's rows 32 s ..., dy's columns) and each 32 output columns q, `build(s, q, dst)` writes
// the steps' B tile pairs (as pass_tiles' build for pass q), every row tile multiplies them,
// and the fp32 sums wait in this thread's buffer (4 KiB per row tile and q) until the next kS
// steps. Each step's weights are thus read front to back, as x W^T reads them (kS pairs of
// blocks at a time); `fetch(s, q)` prefetches those of (s, q), asked kAhead columns ahead. The
// sums are added in pass_tiles' order (steps in order into the same C tiles), so the outputs
// are bitwise pass_tiles'.
// Why: pass_tiles over dy W reads one pass's part of every block in turn (16 pair rows: 512
// or 256 bytes, blocks 32 KiB apart). At 16-32 rows with weights from DRAM that ran
// int8-packed's dy W at 0.45-0.55x of bf16-packed's (in L2, at x W^T's speed), and no prefetch
// distance or level helped. Block pair by block pair with kS = 1 it ran 1.1-1.7x bf16-packed's
// at 16-32 rows, but the sums' traffic cost more than the reads saved from 3 row tiles on;
// kS = 4 cuts that traffic by 4: up to 64 rows it beat pass_tiles for both formats, at 128
// for int8 (int4's ranges overlapped), at 256 for neither; kS = 2 and 8 measured slower
// (benchmarks/results/history.md, "int4-packed; dy W block pair by block pair").
// The sums' buffer is kept within 1 MiB (half this CPU's L2): at K = 2048 that is 128 rows;
// at DeepSeek-V3's K = 7168, 32 (larger K and rows were not measured).
constexpr int64_t kBlockMajorRows = 128;
constexpr int64_t kBlockMajorBytes = int64_t{1} << 20;
constexpr int64_t kS = 4;

template <class Build, class Fetch>
void nn_block_major(const uint16_t* dy, int64_t ld, int64_t rows, int64_t m, int64_t steps,
                    int64_t k, uint16_t* out, int64_t ldo, const Build& build,
                    const Fetch& fetch) {
  const int64_t passes = (k + 31) / 32, tiles = rows / 32;
  // A last row tile of at most 16 rows takes one A tile (as pass_tiles).
  const bool last_half = (m + 15) / 16 % 2 == 1;
  thread_local std::vector<float> acc_buf;
  acc_buf.resize(static_cast<size_t>(tiles * passes * 4 * 256 + 16));
  float* acc = acc_buf.data() + (16 - reinterpret_cast<uintptr_t>(acc_buf.data()) / 4 % 16) % 16;
  thread_local std::vector<uint16_t> bt_buf;  // the B tile pairs of kS steps
  bt_buf.resize(static_cast<size_t>(kS * 2 * kTile + 32));
  uint16_t* bt = bt_buf.data() + (32 - reinterpret_cast<uintptr_t>(bt_buf.data()) / 2 % 32) % 32;
  alignas(64) float c[4][256];
  _tile_loadconfig(&tile_config_16x64());
  for (int64_t s0 = 0; s0 < steps; s0 += kS) {
    const int64_t ns = std::min(kS, steps - s0);
    for (int64_t q = 0; q < passes; ++q) {
      const int64_t qa = q + kAhead;
      for (int64_t i = 0; i < ns; ++i) {
        if (qa < passes) {
          fetch(s0 + i, qa);
        } else if (s0 + kS + i < steps) {
          fetch(s0 + kS + i, qa - passes);
        }
      }
      for (int64_t i = 0; i < ns; ++i) build(s0 + i, q, bt + i * 2 * kTile);
      for (int64_t t = 0; t < tiles; ++t) {
        const bool half = last_half && t + 1 == tiles;
        float* cq = acc + (t * passes + q) * 4 * 256;
        if (s0 == 0) {
          tiles_zero();
        } else {
          _tile_loadd(0, cq, 64);
          _tile_loadd(1, cq + 256, 64);
          if (!half) {
            _tile_loadd(2, cq + 512, 64);
            _tile_loadd(3, cq + 768, 64);
          }
        }
        for (int64_t i = 0; i < ns; ++i) {
          const uint16_t* a = dy + 32 * t * ld + 32 * (s0 + i);
          if (half) {
            tile_step_half(a, ld * 2, bt + i * 2 * kTile, bt + i * 2 * kTile + kTile, 64);
          } else {
            tile_step(a, ld * 2, a + 16 * ld, ld * 2, bt + i * 2 * kTile,
                      bt + i * 2 * kTile + kTile, 64);
          }
        }
        if (s0 + ns < steps) {
          _tile_stored(0, cq, 64);
          _tile_stored(1, cq + 256, 64);
          if (!half) {
            _tile_stored(2, cq + 512, 64);
            _tile_stored(3, cq + 768, 64);
          }
        } else {
          tiles_store(c);
          store_c_tiles<false>(c, 32 * t, m, 32 * q, k, out, ldo, 1.0f);
        }
      }
    }
  }
  _tile_release();
}

// dy W's B tile pair for step s (W's rows 32 s ...) and the 32 output columns from pair row
// p0: B tile j holds rows 8 h + g from block 2 s + h, W's row pair g, from the pair rows
// p0 + 8 j ... p0 + 8 j + 7.
template <class C>
inline void nn_pair(const C& w, int64_t blocks, int64_t s, int64_t p0, __m512i sh,
                    uint16_t* dst) {
  for (int h = 0; h < 2; ++h) {
    const int64_t blk = 2 * s + h;
    if (blk >= blocks) {
      for (int j = 0; j < 2; ++j) {
        std::fill(dst + j * kTile + 8 * 32 * h, dst + j * kTile + 8 * 32 * (h + 1), uint16_t{0});
      }
      continue;
    }
    const auto sc = w.scales(blk, p0);
    const uint8_t* src = w.block(blk);
    for (int j = 0; j < 2; ++j) {
      __m512i v[8];
      for (int i = 0; i < 8; ++i) {
        v[i] = _mm512_shuffle_epi8(w.row(src + C::kPairBytes * (p0 + 8 * j + i), sc), sh);
      }
      transpose8_qwords(v, dst + j * kTile + 8 * 32 * h);
    }
  }
}

template <class C>
void nn(const C& w, const uint16_t* dy_in, int64_t ldi, int64_t m, uint16_t* out, int64_t ldo) {
  const int64_t blocks = ceil_div(w.n, kRows);
  const int64_t steps = ceil_div(blocks, 2);  // 32 rows of W (columns of dy) per tile product
  int64_t ld = 0, rows = 0;
  const uint16_t* dy = padded_rows(dy_in, ldi, m, w.n, ld, rows);
  const __m512i sh = to_rows();
  if (rows <= kBlockMajorRows && rows / 32 * ceil_div(w.k, 32) * 4096 <= kBlockMajorBytes) {
    constexpr int64_t kPass = 16 * C::kPairBytes;  // one block's bytes per 32 columns
    const auto build = [&](int64_t s, int64_t q, uint16_t* dst) {
      nn_pair(w, blocks, s, 16 * q, sh, dst);
    };
    const auto fetch = [&](int64_t s, int64_t q) {
      for (int64_t h = 0; h < 2 && 2 * s + h < blocks; ++h) {
        prefetch_lines<kPass / 64>(w.block(2 * s + h) + kPass * q, true);
      }
    };
    nn_block_major(dy, ld, rows, m, steps, w.k, out, ldo, build, fetch);
    return;
  }
  uint16_t* bt0 = pass_buffer(steps);
  _tile_loadconfig(&tile_config_16x64());
  for (int64_t c0 = 0; c0 < w.k; c0 += 32) {
    const int64_t p0 = c0 / 2;
    const auto build = [&](int64_t s, uint16_t* dst) { nn_pair(w, blocks, s, p0, sh, dst); };
    // Step t reads 16 pair rows of blocks 2 t and 2 t + 1; the next pass, the next 16.
    const auto fetch = [&](int64_t ahead, int64_t t, bool near) {
      if (c0 + 32 * ahead >= w.k) return;
      for (int64_t h = 0; h < 2 && 2 * t + h < blocks; ++h) {
        const uint8_t* p = w.block(2 * t + h) + C::kPairBytes * (p0 + 16 * ahead);
        prefetch_lines<16 * C::kPairBytes / 64>(p, near);
      }
    };
    pass_tiles(dy, ld, rows, m, bt0, steps, c0, w.k, out, ldo, build, fetch);
  }
  _tile_release();
}

// The format's GemvFn body: both products of codec `w` on AMX, in bf16, at any row count
// (below 16 rows, one A tile of zero-padded rows: tile_step_half).
template <class C>
bool products(const C& w, bool nn_product, const void* in, int64_t ldi, int64_t m,
              c10::ScalarType out_dtype, void* out, int64_t ldo) {
  if (out_dtype != at::kBFloat16 || m < 1 || !has_amx()) return false;
  const auto* x = static_cast<const uint16_t*>(in);
  auto* o = static_cast<uint16_t*>(out);
  if (nn_product) {
    nn(w, x, ldi, m, o, ldo);
  } else {
    nt(w, x, ldi, m, o, ldo);
  }
  return true;
}

// The tile W[row0 : row0 + rows, col0 : col0 + cols] in bf16 (the tile loader's contract,
// formats.h), for CPUs without AMX but with AVX512_BF16: per block and 32 columns, the 16
// pair rows widened as the products widen them (bitwise the scalar loader's values), then
// transposed (16 x 16 dwords) to the block's 16 rows of 32 columns.
// Why: the scalar loader ran the whole op with int8-packed at 0.26x dense bf16 and
// int4-packed at 0.20x with AMX off (T=512, E=64), the loader 74-81% of the kernel's time.
template <class C>
void load_bf16(const C& w, int64_t row0, int64_t col0, int64_t rows, int64_t cols,
               uint16_t* out, int64_t ldo) {
  for (int64_t b = row0 / kRows; b * kRows < row0 + rows; ++b) {
    const uint8_t* src = w.block(b);
    const int64_t l0 = std::max<int64_t>(0, row0 - b * kRows);
    const int64_t l1 = std::min<int64_t>(kRows, row0 + rows - b * kRows);
    for (int64_t c = col0 / 32 * 32; c < col0 + cols; c += 32) {
      const auto sc = w.scales(b, c / 2);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = w.row(src + C::kPairBytes * (c / 2 + i), sc);
      transpose16(r);  // r[l]: row 16 b + l, columns c .. c + 31
      // Lanes of r[l] from column max(c, col0) to the tile's end, shifted to lane 0.
      const int64_t skip = std::max<int64_t>(0, col0 - c);
      const int64_t take = std::min<int64_t>(32 - skip, col0 + cols - c - skip);
      const __m512i idx = _mm512_add_epi16(
          _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15,
                           14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi16(static_cast<int16_t>(skip)));
      const __mmask32 mask = take >= 32 ? ~__mmask32{0} : (__mmask32{1} << take) - 1;
      for (int64_t l = l0; l < l1; ++l) {
        uint16_t* o = out + (b * kRows + l - row0) * ldo + (c + skip - col0);
        _mm512_mask_storeu_epi16(o, mask, _mm512_permutexvar_epi16(idx, r[l]));
      }
    }
  }
}

#pragma GCC pop_options
#endif

}  // namespace amx_ints
}  // namespace formats
}  // namespace kt_kernel
