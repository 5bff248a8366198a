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
// one tile step reads 512 contiguous bytes per block (the loops: amx_packed_ints.h, whose pair
// rows here are 32 bytes of q). The products run where the CPU has AMX and the compute dtype
// is bf16, at any row count; the tile loader serves the rest (with AVX512_BF16 for bf16 tiles,
// amx_packed_ints.h's load_bf16; else scalar). "int8_packed_a8" (below) is the same storage with
// W8A8 products on AMX-INT8 tiles.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_packed_ints.h"
#include "formats.h"

namespace kt_kernel {
namespace formats {
namespace {

using amx_ints::kPadBytes;
using amx_ints::kRows;
inline int64_t block_bytes(int64_t k) { return 32 * amx_ints::stride_pairs(k) + kPadBytes; }

void check_int8_packed(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
                       const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 3, what,
                    " (int8_packed) must be 3 tensors (packed, scale, shape), got ", parts.size());
  check_part(parts[0], what, 0, "packed", at::kChar, {e, ceil_div(n, kRows), block_bytes(k)});
  check_part(parts[1], what, 1, "scale", at::kFloat, {e, n});
  check_part(parts[2], what, 2, "shape", at::kLong, {e, 2});
}

void load_int8_scalar(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows,
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
      amx_ints::put_weight(out_dtype, out, r * ldo + c, v);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
// A pair row is the 32 int8 values themselves; a block's scales are one per row, for every
// pair row.
struct Int8Codec {
  static constexpr int64_t kPairBytes = 32;
  const uint8_t* q;
  const float* scale;
  int64_t n, k, block_bytes;
  static Int8Codec of(const ExpertView& w) {
    return {static_cast<const uint8_t*>(w.part[0]), static_cast<const float*>(w.part[1]), w.n,
            w.k, formats::block_bytes(w.k)};
  }
  const uint8_t* block(int64_t b) const { return q + b * block_bytes; }
  amx_ints::Scales scales(int64_t b, int64_t /*p*/) const {
    return amx_ints::spread_scales(
        _mm512_maskz_loadu_ps(first_lanes(n - b * kRows), scale + b * kRows));
  }
  __m512i row(const uint8_t* r, const amx_ints::Scales& s) const {
    return amx_ints::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)), s);
  }
};
#pragma GCC pop_options
#endif

void load_int8_packed(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows,
                      int64_t cols, c10::ScalarType out_dtype, void* out, int64_t ldo) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (out_dtype == at::kBFloat16 && has_avx512_bf16()) {
    amx_ints::load_bf16(Int8Codec::of(w), row0, col0, rows, cols, static_cast<uint16_t*>(out), ldo);
    return;
  }
#endif
  load_int8_scalar(w, row0, col0, rows, cols, out_dtype, out, ldo);
}

bool gemv_int8_packed(const ExpertView& w, bool nn_product, const void* in, int64_t ldi,
                      int64_t m, c10::ScalarType out_dtype, void* out, int64_t ldo) {
#if defined(__x86_64__) && defined(__GNUC__)
  return amx_ints::products(Int8Codec::of(w), nn_product, in, ldi, m, out_dtype, out, ldo);
#else
  (void)w, (void)nn_product, (void)in, (void)ldi, (void)m, (void)out_dtype, (void)out, (void)ldo;
  return false;
#endif
}

// "int8_packed_a8": the same storage, its products on AMX-INT8 tiles with the activations
// quantised per row (W8A8), where the CPU has AMX-INT8; elsewhere int8_packed's products.
// The values, defined exactly (tests/test_int8_packed_a8.py models them bitwise):
// - x W^T: per row r of x, amax_r = max_k |x[r, k]| (fp32), xq = round_even(x * (127 / amax_r))
//   as int8, sx_r = amax_r / 127 (a zero row: sx 0, xq 0); then
//   out[r, n] = bf16((float(sum_k xq[r, k] q[n, k]) * sx_r) * scale[n]).
// - dy W: v[r, n] = dy[r, n] * scale[n] (fp32), quantised per row as x above (sv_r); then
//   out[r, k] = bf16(float(sum_n vq[r, n] q[n, k]) * sv_r).
// The int32 sums are exact; everything else is one fp32 operation at a time.
// Why: on an AMX CPU int8 tiles multiply-add at 2.05x bf16 tiles' rate, and a product that
// builds them from int8 weights ran at 2.0x the bf16 loop at 32 and 128 rows
// (benchmarks/results/history.md, "AMX: the weights' read and the tile products do not
// overlap"). The price is the activations' rounding: 5x the bf16 rounding of the output for
// Gaussian rows at K=2048, 32x with outlier channels.
// The B tiles (TDPBSSD: row i holds, per output column, 4 consecutive int8 of the reduced
// dimension) come from the stored bytes:
// - x W^T: the 64 bytes of pair rows 2i and 2i + 1 (K = 4i .. 4i + 3) with the words of the
//   second half interleaved into the first (one vpermw).
// - dy W: for W's rows 4g .. 4g + 3 of a block and 16 columns, qword g of each of 8 pair rows
//   (two vpermt2q and a vshufi64x2), each qword's bytes reordered from (row, column) to
//   (column, row) (vpshufb).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace a8 {

// The rows of `in` (bf16 [m, cols], row stride ldi; times col_scale[c] in fp32 where given)
// quantised per row into this thread's buffer: int8 [rows][ldq], rows = ceil32(m), ldq =
// ceil64(cols) + 64 bytes (zeros past m and cols), and `scale` [rows] (0 past m).
const int8_t* quantised_rows(const uint16_t* in, int64_t ldi, int64_t m, int64_t cols,
                             const float* col_scale, int64_t& ldq, int64_t& rows,
                             const float*& scale) {
  thread_local std::vector<int8_t> buf;
  thread_local std::vector<float> sbuf;
  ldq = ceil_div(cols, 64) * 64 + 64;
  rows = ceil_div(m, 32) * 32;
  // Each row is written whole below (its quantised columns, then zeros), so the buffer needs
  // no clearing first.
  buf.resize(static_cast<size_t>(rows * ldq));
  sbuf.assign(static_cast<size_t>(rows), 0.0f);
  const auto value = [&](const uint16_t* row, int64_t c, __mmask16 mask) {
    const __m512 v = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, row + c)), 16));
    return col_scale == nullptr ? v : _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, col_scale + c));
  };
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* row = in + r * ldi;
    int8_t* dst = buf.data() + r * ldq;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 mask = first_lanes(cols - c);
      amax = _mm512_max_ps(amax, _mm512_and_ps(value(row, c, mask), sign));
    }
    const float a = _mm512_reduce_max_ps(amax);
    int64_t done = 0;
    if (a != 0.0f) {
      const __m512 inv = _mm512_set1_ps(127.0f / a);
      sbuf[r] = a / 127.0f;
      const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
      for (int64_t c = 0; c < cols; c += 16) {
        const __mmask16 mask = first_lanes(cols - c);
        __m512i qv = _mm512_cvtps_epi32(_mm512_mul_ps(value(row, c, mask), inv));
        qv = _mm512_min_epi32(_mm512_max_epi32(qv, lo), hi);
        _mm_mask_storeu_epi8(dst + c, mask, _mm512_cvtepi32_epi8(qv));
      }
      done = cols;
    }
    std::memset(dst + done, 0, static_cast<size_t>(ldq - done));
  }
  std::memset(buf.data() + m * ldq, 0, static_cast<size_t>((rows - m) * ldq));
  scale = sbuf.data();
  return buf.data();
}

// Row tile m0's C tiles (int32 bits) into bf16 out [m, n] from column c0: (float(c) * rs[r])
// times cs[col] where cs is given; rows past m and columns past n dropped.
inline void store_i32_tiles(const float (&c)[4][256], int64_t m0, int64_t m, int64_t c0,
                            int64_t n, const float* rs, const float* cs, uint16_t* out,
                            int64_t ldo) {
  const __mmask16 mask[2] = {first_lanes(n - c0), first_lanes(n - c0 - 16)};
  for (int i = 0; i < 2; ++i) {
    for (int r = 0; r < 16 && m0 + 16 * i + r < m; ++r) {
      const int64_t row = m0 + 16 * i + r;
      const __m512 sr = _mm512_set1_ps(rs[row]);
      for (int j = 0; j < 2; ++j) {
        if (mask[j] == 0) continue;
        const __m512i acc = _mm512_load_si512(c[2 * i + j] + 16 * r);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), sr);
        if (cs != nullptr) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask[j], cs + c0 + 16 * j));
        _mm256_mask_storeu_epi16(out + row * ldo + c0 + 16 * j, mask[j],
                                 (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

void nt(const ExpertView& w, const uint16_t* x_in, int64_t ldx, int64_t m, uint16_t* out,
        int64_t ldo) {
  const auto* q = static_cast<const uint8_t*>(w.part[0]);
  const auto* scale = static_cast<const float*>(w.part[1]);
  const int64_t n = w.n, k = w.k, bb = block_bytes(k), ps = amx_ints::stride_pairs(k);
  const int64_t blocks = ceil_div(n, kRows), steps = ceil_div(k, 64);
  int64_t ldq = 0, rows = 0;
  const float* sx = nullptr;
  const int8_t* xq = quantised_rows(x_in, ldx, m, k, nullptr, ldq, rows, sx);
  uint16_t* bt0 = pass_buffer(steps);
  // Dword l of a B row: word l of the first pair row, then word l of the second.
  const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                       8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _tile_loadconfig(&tile_config_16x64());
  for (int64_t b = 0; b < blocks; b += 2) {
    // B tile j of step s: row i is block b + j's pair rows 32 s + 2 i and 32 s + 2 i + 1.
    const auto build = [&](int64_t s, uint16_t* dst) {
      for (int j = 0; j < 2; ++j) {
        uint16_t* t = dst + j * kTile;
        const uint8_t* src = q + (b + j) * bb + 1024 * s;
        for (int i = 0; i < 16; ++i) {
          __m512i v = _mm512_setzero_si512();
          if (b + j < blocks && 32 * s + 2 * i < ps) {
            v = _mm512_permutexvar_epi16(mix, _mm512_loadu_si512(src + 64 * i));
          }
          _mm512_store_si512(t + 32 * i, v);
        }
      }
    };
    // Step t reads 1 KiB of each of the pass's two blocks.
    const auto fetch = [&](int64_t ahead, int64_t t, bool near) {
      for (int64_t j = 2 * ahead; j < 2 * ahead + 2 && b + j < blocks; ++j) {
        if (32 * t < ps) prefetch_kib(q + (b + j) * bb + 1024 * t, near);
      }
    };
    const int64_t c0 = b * kRows;
    pass_tiles_to<true>(reinterpret_cast<const uint16_t*>(xq), ldq / 2, rows, m, bt0, steps,
                        build, fetch, [&](const float (&c)[4][256], int64_t m0) {
                          store_i32_tiles(c, m0, m, c0, n, sx, scale, out, ldo);
                        });
  }
  _tile_release();
}

void nn(const ExpertView& w, const uint16_t* dy_in, int64_t ldi, int64_t m, uint16_t* out,
        int64_t ldo) {
  const auto* q = static_cast<const uint8_t*>(w.part[0]);
  const auto* scale = static_cast<const float*>(w.part[1]);
  const int64_t n = w.n, k = w.k, bb = block_bytes(k);
  const int64_t blocks = ceil_div(n, kRows), steps = ceil_div(n, 64);  // 4 blocks a step
  int64_t ldq = 0, rows = 0;
  const float* sv = nullptr;
  const int8_t* vq = quantised_rows(dy_in, ldi, m, n, scale, ldq, rows, sv);
  uint16_t* bt0 = pass_buffer(steps);
  // Per qword (rows l .. l + 3, each (column 2p, column 2p + 1)): column 2p's 4 rows, then
  // column 2p + 1's.
  const __m512i order = _mm512_set4_epi32(0x0f0d0b09, 0x0e0c0a08, 0x07050301, 0x06040200);
  _tile_loadconfig(&tile_config_16x64());
  for (int64_t c0 = 0; c0 < k; c0 += 32) {
    const int64_t p0 = c0 / 2;
    // B tile j of step s (columns c0 + 16 j ...): row 4 h + g is W's rows 4 g .. 4 g + 3 of
    // block 4 s + h.
    const auto build = [&](int64_t s, uint16_t* dst) {
      for (int j = 0; j < 2; ++j) {
        for (int h = 0; h < 4; ++h) {
          uint16_t* t = dst + j * kTile + 4 * 32 * h;
          const int64_t blk = 4 * s + h;
          if (blk >= blocks) {
            std::fill(t, t + 4 * 32, uint16_t{0});
            continue;
          }
          const uint8_t* src = q + blk * bb + 32 * (p0 + 8 * j);
          __m512i z[4];
          for (int i = 0; i < 4; ++i) z[i] = _mm512_loadu_si512(src + 64 * i);
          for (int g = 0; g < 4; ++g) {
            const __m512i idx = _mm512_setr_epi64(g, 4 + g, 8 + g, 12 + g, g, 4 + g, 8 + g, 12 + g);
            const __m512i lo = _mm512_permutex2var_epi64(z[0], idx, z[1]);
            const __m512i hi = _mm512_permutex2var_epi64(z[2], idx, z[3]);
            const __m512i row = _mm512_shuffle_i64x2(lo, hi, 0x44);
            _mm512_store_si512(t + 32 * g, _mm512_shuffle_epi8(row, order));
          }
        }
      }
    };
    // Step t reads 512 bytes (16 pair rows) of blocks 4 t .. 4 t + 3; the next pass, the next.
    const auto fetch = [&](int64_t ahead, int64_t t, bool near) {
      if (c0 + 32 * ahead >= k) return;
      for (int64_t h = 0; h < 4 && 4 * t + h < blocks; ++h) {
        amx_ints::prefetch_lines<8>(q + (4 * t + h) * bb + 32 * (p0 + 16 * ahead), near);
      }
    };
    pass_tiles_to<true>(reinterpret_cast<const uint16_t*>(vq), ldq / 2, rows, m, bt0, steps,
                        build, fetch, [&](const float (&c)[4][256], int64_t m0) {
                          store_i32_tiles(c, m0, m, c0, k, sv, nullptr, out, ldo);
                        });
  }
  _tile_release();
}

}  // namespace a8
#pragma GCC pop_options
#endif

bool gemv_int8_packed_a8(const ExpertView& w, bool nn_product, const void* in, int64_t ldi,
                         int64_t m, c10::ScalarType out_dtype, void* out, int64_t ldo) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (out_dtype != at::kBFloat16 || m < 1) return false;
  if (!has_amx_int8()) return gemv_int8_packed(w, nn_product, in, ldi, m, out_dtype, out, ldo);
  const auto* x = static_cast<const uint16_t*>(in);
  auto* o = static_cast<uint16_t*>(out);
  if (nn_product) {
    a8::nn(w, x, ldi, m, o, ldo);
  } else {
    a8::nt(w, x, ldi, m, o, ldo);
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
// The same storage and loader; the products W8A8 where the CPU has AMX-INT8, else int8_packed's.
KT_REGISTER_FORMAT(int8_packed_a8, Format{"int8_packed_a8", 3, check_int8_packed,
                                          load_int8_packed, 8, gemv_int8_packed_a8, has_amx});

}  // namespace formats
}  // namespace kt_kernel
