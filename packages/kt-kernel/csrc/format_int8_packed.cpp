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
// amx_packed_ints.h's load_bf16; else scalar).
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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

}  // namespace

// Rows padded to 8 as int8's; with AMX the products serve every row count.
KT_REGISTER_FORMAT(int8_packed, Format{"int8_packed", 3, check_int8_packed, load_int8_packed, 8,
                                       gemv_int8_packed, has_amx});

}  // namespace formats
}  // namespace kt_kernel
