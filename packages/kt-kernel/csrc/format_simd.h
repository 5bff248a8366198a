// Small SIMD helpers shared by the INT4 and FP8 tile loaders (format_int4.cpp, format_fp8.cpp).
// The extension is built without -march=native: every SIMD function carries a GCC target
// attribute and is only called where isa_level() allows it.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

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

}  // namespace simd
}  // namespace formats
}  // namespace kt_kernel
#endif
