// INT8 per-channel weights repacked once at load for the AMX products: the "int8_packed" format.
//
// Part 0 of one expert's W [N, K] is int8 [ceil(N/16), 32 Ps + 64], Ps = ceil(K/2) rounded up
// to 16: row b (block b: output rows 16b .. 16b + 15) holds, for each column pair p < Ps and
// row l < 16, q[16b + l, 2p + h] at 32 p + 2 l + h (h < 2), then 64 zeros; rows past N and
// columns past K hold zeros. Part 1 is the fp32 scale [N] (W[n, k] = q[n, k] * scale[n],
// formed in fp32 and rounded once, as int8's), part 2 int64 [2]: N and K.
//
// Why this layout: int8's own AMX products over its row-major q ran at 0.81x dense bf16 at
// T=512, bound by reading the weights (a step's KiB lay on 32 rows); with the same loop's
// weights in cache, 1.78x (benchmarks/results/history.md, "The quantised bases on AMX"). Here
// one tile step reads 512 contiguous bytes per block:
// - x W^T: row p of a B tile is the block's 32 bytes at pair p, widened, scaled and rounded
//   to 16 bf16 pairs (W[n, 2p], W[n, 2p + 1]), as AMX wants them, with no transpose.
// - dy W: 8 such rows, shuffled to row pairs (to_rows) and transposed as qwords, give 8 rows
//   of W's row pairs for 16 columns.
// The 64 zero bytes ending each block keep the blocks' stride off multiples of 4 KiB. The
// products run where the CPU has AMX and the compute dtype is bf16, at any row count; the
// tile loader (scalar) serves the rest, which is slow: the format is for AMX CPUs.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "formats.h"

namespace kt_kernel {
namespace formats {
namespace {

constexpr int64_t kRows = 16;  // output rows per block
constexpr int64_t kPadBytes = 64;

inline int64_t stride_pairs(int64_t k) { return ceil_div(ceil_div(k, 2), 16) * 16; }
inline int64_t block_bytes(int64_t k) { return 32 * stride_pairs(k) + kPadBytes; }

void check_int8_packed(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
                       const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 3, what,
                    " (int8_packed) must be 3 tensors (packed, scale, shape), got ", parts.size());
  check_part(parts[0], what, 0, "packed", at::kChar, {e, ceil_div(n, kRows), block_bytes(k)});
  check_part(parts[1], what, 1, "scale", at::kFloat, {e, n});
  check_part(parts[2], what, 2, "shape", at::kLong, {e, 2});
}

void load_int8_packed(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows,
                      int64_t cols, c10::ScalarType out_dtype, void* out, int64_t ldo) {
  const auto* q = static_cast<const int8_t*>(w.part[0]);
  const auto* scale = static_cast<const float*>(w.part[1]);
  const int64_t bb = block_bytes(w.k);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = row0 + r;
    const int8_t* blk = q + (n / kRows) * bb + 2 * (n % kRows);
    const float s = scale[n];
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t j = col0 + c;
      const float v = static_cast<float>(blk[32 * (j / 2) + (j & 1)]) * s;
      if (out_dtype == at::kBFloat16) {
        static_cast<uint16_t*>(out)[r * ldo + c] = c10::BFloat16(v).x;
      } else {
        static_cast<float*>(out)[r * ldo + c] = v;
      }
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace amx {

// A block's scales per lane of a widened pair row: lanes 2l, 2l + 1 hold scale[16b + l] for
// l < 8 (lo) and l >= 8 (hi); zero past N (those rows' q are zero too).
struct Scales {
  __m512 lo, hi;
};

inline Scales block_scales(const float* scale, int64_t n, int64_t b) {
  const __m512 s = _mm512_maskz_loadu_ps(first_lanes(n - b * kRows), scale + b * kRows);
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  return {_mm512_permutexvar_ps(lo, s), _mm512_permutexvar_ps(hi, s)};
}

// The 32 bytes at p (16 rows' pairs) as 16 bf16 pairs: q * scale in fp32, rounded once.
inline __m512i pair_row(const int8_t* p, const Scales& s) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512 lo = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))), s.lo);
  const __m512 hi = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))), s.hi);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// The 8 lines (512 bytes) from p, to L1 when near, else to L2.
inline void prefetch_512(const int8_t* p, bool near) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int l = 0; l < 8; ++l) _mm_prefetch(c + 64 * l, near ? _MM_HINT_T0 : _MM_HINT_T1);
}

void nt(const int8_t* q, const float* scale, int64_t n, int64_t k, const uint16_t* x_in,
        int64_t ldx, int64_t m, uint16_t* out, int64_t ldo) {
  const int64_t bb = block_bytes(k), blocks = ceil_div(n, kRows), steps = ceil_div(k, 32);
  int64_t ld = 0, rows = 0;
  const uint16_t* x = padded_rows(x_in, ldx, m, k, ld, rows);
  uint16_t* bt0 = pass_buffer(steps);
  _tile_loadconfig(&tile_config_16x64());  // per call: oneDNN loads its own on this thread
  for (int64_t b = 0; b < blocks; b += 2) {
    const Scales s0 = block_scales(scale, n, b);
    const Scales s1 = b + 1 < blocks ? block_scales(scale, n, b + 1) : s0;
    // B tile j of step s: row r is pair_row of block b + j at pair 16 s + r.
    const auto build = [&](int64_t s, uint16_t* dst) {
      for (int j = 0; j < 2; ++j) {
        uint16_t* t = dst + j * kTile;
        if (b + j >= blocks) {
          std::fill(t, t + kTile, uint16_t{0});
          continue;
        }
        const int8_t* src = q + (b + j) * bb + 512 * s;
        const Scales& sc = j == 0 ? s0 : s1;
        for (int r = 0; r < 16; ++r) _mm512_store_si512(t + 32 * r, pair_row(src + 32 * r, sc));
      }
    };
    // Step t reads 512 bytes of each of the pass's two blocks.
    const auto fetch = [&](int64_t ahead, int64_t t, bool near) {
      for (int64_t j = 2 * ahead; j < 2 * ahead + 2 && b + j < blocks; ++j) {
        prefetch_512(q + (b + j) * bb + 512 * t, near);
      }
    };
    pass_tiles(x, ld, rows, m, bt0, steps, b * kRows, n, out, ldo, build, fetch);
  }
  _tile_release();
}

void nn(const int8_t* q, const float* scale, int64_t n, int64_t k, const uint16_t* dy_in,
        int64_t ldi, int64_t m, uint16_t* out, int64_t ldo) {
  const int64_t bb = block_bytes(k), blocks = ceil_div(n, kRows);
  const int64_t steps = ceil_div(blocks, 2);  // 32 rows of W (columns of dy) per tile product
  int64_t ld = 0, rows = 0;
  const uint16_t* dy = padded_rows(dy_in, ldi, m, n, ld, rows);
  uint16_t* bt0 = pass_buffer(steps);
  const __m512i sh = to_rows();
  _tile_loadconfig(&tile_config_16x64());
  for (int64_t c0 = 0; c0 < k; c0 += 32) {
    const int64_t p0 = c0 / 2;
    // B tile j of step s (output columns c0 + 16 j ...): rows 8 h + g from block 2 s + h,
    // W's row pair g, from the pair rows p0 + 8 j ... p0 + 8 j + 7.
    const auto build = [&](int64_t s, uint16_t* dst) {
      for (int h = 0; h < 2; ++h) {
        const int64_t blk = 2 * s + h;
        if (blk >= blocks) {
          for (int j = 0; j < 2; ++j) {
            std::fill(dst + j * kTile + 8 * 32 * h, dst + j * kTile + 8 * 32 * (h + 1),
                      uint16_t{0});
          }
          continue;
        }
        const Scales sc = block_scales(scale, n, blk);
        const int8_t* src = q + blk * bb;
        for (int j = 0; j < 2; ++j) {
          __m512i v[8];
          for (int i = 0; i < 8; ++i) {
            v[i] = _mm512_shuffle_epi8(pair_row(src + 32 * (p0 + 8 * j + i), sc), sh);
          }
          transpose8_qwords(v, dst + j * kTile + 8 * 32 * h);
        }
      }
    };
    // Step t reads 512 bytes of blocks 2 t and 2 t + 1; the next pass, the next 16 pairs.
    const auto fetch = [&](int64_t ahead, int64_t t, bool near) {
      if (c0 + 32 * ahead >= k) return;
      for (int64_t h = 0; h < 2 && 2 * t + h < blocks; ++h) {
        prefetch_512(q + (2 * t + h) * bb + 32 * (p0 + 16 * ahead), near);
      }
    };
    pass_tiles(dy, ld, rows, m, bt0, steps, c0, k, out, ldo, build, fetch);
  }
  _tile_release();
}

}  // namespace amx
#pragma GCC pop_options
#endif

bool gemv_int8_packed(const ExpertView& w, bool nn_product, const void* in, int64_t ldi,
                      int64_t m, c10::ScalarType out_dtype, void* out, int64_t ldo) {
#if defined(__x86_64__) && defined(__GNUC__)
  // Every row count: below 16 rows one A tile of zero-padded rows (tile_step_half) still
  // beats the scalar tile loader by far.
  if (out_dtype != at::kBFloat16 || m < 1 || !has_amx()) return false;
  const auto* q = static_cast<const int8_t*>(w.part[0]);
  const auto* scale = static_cast<const float*>(w.part[1]);
  const auto* x = static_cast<const uint16_t*>(in);
  auto* o = static_cast<uint16_t*>(out);
  if (nn_product) {
    amx::nn(q, scale, w.n, w.k, x, ldi, m, o, ldo);
  } else {
    amx::nt(q, scale, w.n, w.k, x, ldi, m, o, ldo);
  }
  return true;
#else
  (void)w, (void)nn_product, (void)in, (void)ldi, (void)m, (void)out_dtype, (void)out, (void)ldo;
  return false;
#endif
}

}  // namespace

// Rows padded to 8 as int8's; with AMX the products serve every row count.
KT_REGISTER_FORMAT(int8_packed, Format{"int8_packed", 3, check_int8_packed, load_int8_packed, 8,
                                       gemv_int8_packed, has_amx});

}  // namespace formats
}  // namespace kt_kernel
