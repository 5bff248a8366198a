// What the INT4 and FP8 tile loaders (format_int4.cpp, format_fp8.cpp) share: the choice of
// their per-row routines by ISA (pick_rows, KT_ROW_TABLE) and small SIMD helpers.
// The extension is built without -march=native: every SIMD function carries a GCC target
// attribute and is only called where isa_level() allows it.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "formats.h"

namespace kt_kernel {
namespace formats {

// For the small-row routines (Format::gemv): rows [0, m) in register blocks of at most MaxRows
// rows. Calls `block.template operator()<R>(r0)` for each block, R (1..MaxRows) being its row
// count, so a kernel templated on its rows is instantiated once per height and no routine
// carries a switch of its own.
template <int MaxRows, typename Block>
inline void for_row_blocks(int64_t m, const Block& block) {
  const auto one = [&]<int... R>(int64_t r0, int64_t rows, std::integer_sequence<int, R...>) {
    ((rows == R + 1 && (block.template operator()<R + 1>(r0), true)) || ...);
  };
  for (int64_t r0 = 0; r0 < m; r0 += MaxRows) {
    one(r0, std::min<int64_t>(MaxRows, m - r0), std::make_integer_sequence<int, MaxRows>{});
  }
}

// For the small-row routines: a bf16 copy of rows [0, m) x cols [0, cols) of `in` (row stride
// ldi), zero up to `ld` columns.
inline const uint16_t* rows_bf16(const void* in, int64_t ldi, int64_t m, int64_t cols,
                                 int64_t ld, std::vector<uint16_t>& buf) {
  buf.assign(static_cast<size_t>(m * ld), 0);
  for (int64_t r = 0; r < m; ++r) {
    std::memcpy(buf.data() + r * ld, static_cast<const uint16_t*>(in) + r * ldi,
                static_cast<size_t>(cols) * 2);
  }
  return buf.data();
}

// A tile loader's per-row routines, one per output dtype, as picked for this process.
template <typename Fn>
struct RowFns {
  Fn f32, bf16;
};

// Every path of a loader's row routines; the SIMD entries are null where the build has none.
template <typename Fn>
struct RowPaths {
  Fn f32_scalar, bf16_scalar;
  Fn f32_avx2 = nullptr, bf16_avx2 = nullptr;
  Fn f32_avx512 = nullptr, bf16_avx512 = nullptr, bf16_avx512bf16 = nullptr;
};

// The best of `p` that isa_level() (the CPU, capped by KT_KERNEL_ISA) allows; bf16 output on
// AVX-512 uses vcvtneps2bf16 where the CPU has AVX512_BF16.
template <typename Fn>
RowFns<Fn> pick_rows(const RowPaths<Fn>& p) {
  const Isa level = isa_level();
  if (level == Isa::kAvx512 && p.f32_avx512 != nullptr) {
    return {p.f32_avx512, has_avx512_bf16() ? p.bf16_avx512bf16 : p.bf16_avx512};
  }
  if (level == Isa::kAvx2 && p.f32_avx2 != nullptr) return {p.f32_avx2, p.bf16_avx2};
  return {p.f32_scalar, p.bf16_scalar};
}

}  // namespace formats
}  // namespace kt_kernel

// Defines `const RowFns<RowFn>& rows_table()`, the routines of this process picked once by
// pick_rows, for a loader whose row routines are named row_{f32,bf16}_{scalar,avx2,avx512}
// and row_bf16_avx512bf16 (the SIMD ones only where KT_FMT_SIMD is defined).
#if defined(__x86_64__) && defined(__GNUC__)
#define KT_ROW_TABLE(RowFn)                                                                 \
  const RowFns<RowFn>& rows_table() {                                                       \
    static const RowFns<RowFn> t = pick_rows<RowFn>(                                        \
        {row_f32_scalar, row_bf16_scalar, row_f32_avx2, row_bf16_avx2, row_f32_avx512,      \
         row_bf16_avx512, row_bf16_avx512bf16});                                           \
    return t;                                                                               \
  }
#else
#define KT_ROW_TABLE(RowFn)                                                                 \
  const RowFns<RowFn>& rows_table() {                                                       \
    static const RowFns<RowFn> t = pick_rows<RowFn>({row_f32_scalar, row_bf16_scalar});     \
    return t;                                                                               \
  }
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define KT_FMT_SIMD 1
#define KT_FMT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define KT_FMT_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define KT_FMT_AVX2 __attribute__((target("avx2,fma")))

namespace kt_kernel {
namespace formats {
namespace simd {

// fp32 -> bf16, round to nearest even, 8 lanes (as c10::BFloat16 for finite inputs).
KT_FMT_AVX2 inline __m128i f32_to_bf16_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The same on 16 lanes without AVX512_BF16 (Skylake-X/Ice Lake class CPUs).
KT_FMT_AVX512 inline __m256i f32_to_bf16_avx512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_cvtepi32_epi16(r);
}

// 8 weights w to output column j of a row of fp32 or (rounded to nearest even) bf16.
template <bool Bf16>
KT_FMT_AVX2 inline void store8_avx2(void* out, int64_t j, __m256 w) {
  if (Bf16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + j),
                     f32_to_bf16_avx2(w));
  } else {
    _mm256_storeu_ps(static_cast<float*>(out) + j, w);
  }
}

// Runs `scalar(r)` on columns [j0, j1) of the row `a` (a RowArgs with col0, cols and out): the
// head and tail that a row routine's SIMD body leaves.
template <bool Bf16, typename Args, typename Scalar>
inline void scalar_cols(const Args& a, int64_t j0, int64_t j1, const Scalar& scalar) {
  if (j1 <= j0) return;
  Args r = a;
  r.col0 = a.col0 + j0;
  r.cols = j1 - j0;
  r.out = static_cast<char*>(a.out) + j0 * (Bf16 ? 2 : 4);
  scalar(r);
}

// Stores of a row routine's 16 (masked: m) weights w at output column j of `a.out`, for the
// row macros of format_int4.cpp and format_fp8.cpp (each variant keeps only its own targets).
#define KT_STORE_F32(j, m, w) _mm512_mask_storeu_ps(static_cast<float*>(a.out) + (j), m, w)
#define KT_STORE_BF16_NATIVE(j, m, w) \
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + (j), m, (__m256i)_mm512_cvtneps_pbh(w))
#define KT_STORE_BF16_INT(j, m, w) \
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.out) + (j), m, simd::f32_to_bf16_avx512(w))

}  // namespace simd
}  // namespace formats
}  // namespace kt_kernel
#endif
