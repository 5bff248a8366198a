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

// With one row tile (at most 32 rows), the first of each two passes of dy W reads and widens
// both passes' pair rows, so that each block is read in runs of two passes' bytes: int8-packed's
// dy W at 32 rows (gate_up of Qwen3-30B-A3B, weights from DRAM) took 0.58x the time of one pass
// at a time; int4-packed's, 0.98x; four passes (1 KiB runs for int4) took 1.10x. At 128 rows
// two passes took 1.07x (int8) and 0.99x (int4), four 1.51x (int4): the grouped build leaves
// DRAM idle while the later passes multiply (benchmarks/results/history.md, "int4-packed").
constexpr int64_t kNnGroup = 2;
template <class C>
void nn(const C& w, const uint16_t* dy_in, int64_t ldi, int64_t m, uint16_t* out, int64_t ldo) {
  constexpr int64_t kPass = 16 * C::kPairBytes;  // one block's bytes per pass and step
  const int64_t blocks = ceil_div(w.n, kRows);
  const int64_t steps = ceil_div(blocks, 2);  // 32 rows of W (columns of dy) per tile product
  int64_t ld = 0, rows = 0;
  const uint16_t* dy = padded_rows(dy_in, ldi, m, w.n, ld, rows);
  uint16_t* bt0 = pass_buffer(steps);
  const int64_t group = rows == 32 ? kNnGroup : 1;
  // The B tiles of a group's later passes, built by its first.
  thread_local std::vector<uint16_t> later;
  later.resize(static_cast<size_t>((group - 1) * steps * 2 * kTile));
  const __m512i sh = to_rows();
  _tile_loadconfig(&tile_config_16x64());
  for (int64_t g0 = 0; g0 < w.k; g0 += 32 * group) {
    const int64_t passes = std::min(group, ceil_div(w.k - g0, 32));
    const auto later_tiles = [&](int64_t q, int64_t s) {
      return later.data() + ((q - 1) * steps + s) * 2 * kTile;
    };
    // Pass q's B tile j of step s (output columns g0 + 32 q + 16 j ...): rows 8 h + g from
    // block 2 s + h, W's row pair g, from the pair rows p0 + 8 j ... p0 + 8 j + 7. Each block's
    // pair rows are read in order, every pass's in turn.
    const auto build = [&](int64_t s, uint16_t* dst) {
      for (int h = 0; h < 2; ++h) {
        const int64_t blk = 2 * s + h;
        for (int64_t q = 0; q < passes; ++q) {
          uint16_t* t = q == 0 ? dst : later_tiles(q, s);
          if (blk >= blocks) {
            for (int j = 0; j < 2; ++j) {
              std::fill(t + j * kTile + 8 * 32 * h, t + j * kTile + 8 * 32 * (h + 1),
                        uint16_t{0});
            }
            continue;
          }
          const int64_t p0 = g0 / 2 + 16 * q;
          const auto sc = w.scales(blk, p0);
          const uint8_t* src = w.block(blk);
          for (int j = 0; j < 2; ++j) {
            __m512i v[8];
            for (int i = 0; i < 8; ++i) {
              const uint8_t* row = src + C::kPairBytes * (p0 + 8 * j + i);
              v[i] = _mm512_shuffle_epi8(w.row(row, sc), sh);
            }
            transpose8_qwords(v, t + j * kTile + 8 * 32 * h);
          }
        }
      }
    };
    // Step t of the group's first pass reads `passes` runs of kPass bytes of blocks 2 t and
    // 2 t + 1; a later pass reads nothing, and its last asks for the next group's.
    const auto fetch_group = [&](int64_t g, int64_t t, bool near) {
      if (g >= w.k) return;
      const int64_t lines = std::min(group, ceil_div(w.k - g, 32)) * kPass / 64;
      for (int64_t h = 0; h < 2 && 2 * t + h < blocks; ++h) {
        const char* p = reinterpret_cast<const char*>(w.block(2 * t + h) + C::kPairBytes * g / 2);
        for (int64_t l = 0; l < lines; ++l) {
          _mm_prefetch(p + 64 * l, near ? _MM_HINT_T0 : _MM_HINT_T1);
        }
      }
    };
    for (int64_t q = 0; q < passes; ++q) {
      const int64_t c0 = g0 + 32 * q;
      const auto fetch = [&](int64_t ahead, int64_t t, bool near) {
        if (ahead == 0 && q == 0) fetch_group(g0, t, near);
        if (ahead == 1 && q == passes - 1) fetch_group(g0 + 32 * group, t, near);
      };
      if (q == 0) {
        pass_tiles(dy, ld, rows, m, bt0, steps, c0, w.k, out, ldo, build, fetch);
        continue;
      }
      // Copied only where pass_tiles builds in a buffer of its own (one row tile).
      const auto copy = [&](int64_t s, uint16_t* dst) {
        const uint16_t* src = later_tiles(q, s);
        if (dst != src) std::memcpy(dst, src, 2 * kTile * sizeof(uint16_t));
      };
      pass_tiles(dy, ld, rows, m, later_tiles(q, 0), steps, c0, w.k, out, ldo, copy, fetch);
    }
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

#pragma GCC pop_options
#endif

}  // namespace amx_ints
}  // namespace formats
}  // namespace kt_kernel
