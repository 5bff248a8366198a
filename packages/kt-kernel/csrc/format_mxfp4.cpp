// The MXFP4 format (kt_kernel.formats_mxfp4.Mxfp4), the layout GPT-OSS ships its experts in
// (`*_blocks` and `*_scales`, OCP microscaling). Parts per expert, G = ceil(K / 32):
//   blocks uint8 [N, G, 16]: 32 E2M1 (FP4) values per (row, group), two per byte, the value of
//                            the even column in the LOW nibble (column 2j: byte j & 0xF, 2j + 1:
//                            byte j >> 4), as transformers' convert_moe_packed_tensors reads them;
//   scales uint8 [N, G]:     one E8M0 exponent per (row, group): 2^(s - 127); 255 is NaN.
// W[n, k] = E2M1(nibble) * 2^(scales[n, k / 32] - 127), formed in fp32. E2M1 has two significant
// bits, so that product is exact (an fp32 denormal at the smallest scales, never rounded) and
// a bf16 tile holds it exactly too (bf16 has fp32's exponent range); every ISA path forms it
// with the same fp32 multiply, so tiles are bitwise equal to the Python dequantize.
//
// E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
// negatives (the OCP MX spec's table; transformers' FP4_VALUES).
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "format_simd.h"
#include "formats.h"

namespace kt_kernel {
namespace formats {
namespace {

constexpr int64_t kGroup = 32;  // inputs per E8M0 scale
constexpr int64_t kGroupBytes = kGroup / 2;

alignas(64) constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(s - 127) as fp32, built from bits (no pow, no denormal arithmetic): s = 0 is the denormal
// 2^-127, 255 the E8M0 NaN.
inline float e8m0(uint8_t s) {
  if (s == 255) return std::numeric_limits<float>::quiet_NaN();
  const uint32_t bits = s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// One output row: out[j] = W[n, col0 + j] for j < cols; `src` is row n of blocks (G * 16
// bytes), `scale` row n of scales (G bytes).
struct RowArgs {
  const uint8_t* src;
  const uint8_t* scale;
  int64_t col0, cols;
  void* out;
};
using RowFn = void (*)(const RowArgs& a);

inline float w_at(const RowArgs& a, int64_t c) {
  const uint8_t b = a.src[c >> 1];
  const int nib = (c & 1) ? (b >> 4) : (b & 0xF);
  return kE2M1[nib] * e8m0(a.scale[c / kGroup]);
}

void row_f32_scalar(const RowArgs& a) {
  float* o = static_cast<float*>(a.out);
  for (int64_t j = 0; j < a.cols; ++j) o[j] = w_at(a, a.col0 + j);
}

void row_bf16_scalar(const RowArgs& a) {
  c10::BFloat16* o = static_cast<c10::BFloat16*>(a.out);
  for (int64_t j = 0; j < a.cols; ++j) o[j] = c10::BFloat16(w_at(a, a.col0 + j));
}

#ifdef KT_FMT_SIMD
// Columns before the first multiple of 16 go through the scalar path; from there every
// 16-column unit starts on a byte and lies inside one 32-column group.
inline int64_t head_cols(const RowArgs& a) { return std::min(a.cols, (16 - a.col0 % 16) % 16); }

// 8 packed bytes (the first `m` of them) -> their 16 nibbles in column order, as bytes.
KT_FMT_AVX512 inline __m128i nibbles16(const uint8_t* p, __mmask16 m) {
  const __m128i b = _mm_maskz_loadu_epi8(m, p);
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
}

// One row on AVX-512: the 16-entry E2M1 table is one register (vpermps). STORE(j, m, w)
// writes 16 (masked) weights at output column j.
#define KT_MXFP4_ROW_AVX512(NAME, ATTR, SCALAR, STORE)                                     \
  ATTR void NAME(const RowArgs& a) {                                                         \
    const int64_t head = head_cols(a);                                                       \
    if (head > 0) {                                                                          \
      RowArgs h = a;                                                                         \
      h.cols = head;                                                                         \
      SCALAR(h);                                                                             \
    }                                                                                        \
    const __m512 lut = _mm512_load_ps(kE2M1);                                                \
    for (int64_t j = head; j < a.cols; j += 16) {                                            \
      const int64_t c = a.col0 + j;                                                          \
      const int64_t left = std::min<int64_t>(16, a.cols - j);                                \
      const __mmask16 m = static_cast<__mmask16>(left == 16 ? 0xFFFFu : (1u << left) - 1u);   \
      const __mmask16 mb = static_cast<__mmask16>((1u << ((left + 1) / 2)) - 1u);            \
      const __m512i idx = _mm512_cvtepu8_epi32(nibbles16(a.src + (c >> 1), mb));             \
      const __m512 w = _mm512_mul_ps(_mm512_permutexvar_ps(idx, lut),                        \
                                     _mm512_set1_ps(e8m0(a.scale[c / kGroup])));             \
      STORE(j, m, w);                                                                        \
    }                                                                                        \
  }

KT_MXFP4_ROW_AVX512(row_f32_avx512, KT_FMT_AVX512, row_f32_scalar, KT_STORE_F32)
// bf16 with integer rounding on every AVX-512 CPU, AVX512_BF16 or not: vcvtneps2bf16 flushes
// fp32 denormals to zero, and the products of the two smallest scales (s = 0, 1) are
// denormals, which bf16 holds exactly (the scalar path and torch keep them).
KT_MXFP4_ROW_AVX512(row_bf16_avx512, KT_FMT_AVX512, row_bf16_scalar, KT_STORE_BF16_INT)
KT_FMT_AVX512 void row_bf16_avx512bf16(const RowArgs& a) { row_bf16_avx512(a); }

// 4 packed bytes -> 8 fp32 weights times s: the magnitude (nibble & 7) through an 8-entry
// vpermps table, the sign (bit 3) moved to bit 31.
KT_FMT_AVX2 inline __m256 unit8_avx2(const uint8_t* p, __m256 lut, __m256 s) {
  uint32_t word;
  std::memcpy(&word, p, 4);
  const __m128i b = _mm_cvtsi32_si128(static_cast<int>(word));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i nib =
      _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
  const __m256i idx = _mm256_cvtepu8_epi32(nib);
  const __m256 mag = _mm256_permutevar8x32_ps(lut, _mm256_and_si256(idx, _mm256_set1_epi32(7)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign)), s);
}

template <bool Bf16>
KT_FMT_AVX2 void row_avx2_impl(const RowArgs& a) {
  const int64_t head = head_cols(a);
  const int64_t body = head + (a.cols - head) / 8 * 8;
  const __m256 lut = _mm256_loadu_ps(kE2M1);
  for (int64_t j = head; j < body; j += 8) {
    const int64_t c = a.col0 + j;
    const __m256 w = unit8_avx2(a.src + (c >> 1), lut, _mm256_set1_ps(e8m0(a.scale[c / kGroup])));
    simd::store8_avx2<Bf16>(a.out, j, w);
  }
  const auto scalar = [&](const RowArgs& r) {
    if (Bf16) {
      row_bf16_scalar(r);
    } else {
      row_f32_scalar(r);
    }
  };
  simd::scalar_cols<Bf16>(a, 0, head, scalar);
  simd::scalar_cols<Bf16>(a, body, a.cols, scalar);
}

KT_FMT_AVX2 void row_f32_avx2(const RowArgs& a) { row_avx2_impl<false>(a); }
KT_FMT_AVX2 void row_bf16_avx2(const RowArgs& a) { row_avx2_impl<true>(a); }
#endif

KT_ROW_TABLE(RowFn)

void load_mxfp4(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows, int64_t cols,
                c10::ScalarType dt, void* out, int64_t ldo) {
  TORCH_CHECK_TYPE(dt == c10::ScalarType::Float || dt == c10::ScalarType::BFloat16,
                   "mxfp4 format: compute dtype must be float32 or bfloat16, got ", dt);
  const auto* blocks = static_cast<const uint8_t*>(w.part[0]);
  const auto* scales = static_cast<const uint8_t*>(w.part[1]);
  const int64_t groups = ceil_div(w.k, kGroup);
  const bool bf16 = dt == c10::ScalarType::BFloat16;
  const RowFn fn = bf16 ? rows_table().bf16 : rows_table().f32;
  const size_t esize = bf16 ? 2 : 4;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = row0 + r;
    RowArgs a{blocks + n * groups * kGroupBytes, scales + n * groups, col0, cols,
              static_cast<char*>(out) + static_cast<size_t>(r * ldo) * esize};
    fn(a);
  }
}

void check_mxfp4(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
                 const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 2, what, " (mxfp4) must be 2 tensors (blocks, scales), got ",
                    parts.size());
  TORCH_CHECK_VALUE(n >= 0 && k >= 0, what, " (mxfp4): n and k must be >= 0, got ", n, " and ",
                    k);
  const int64_t g = ceil_div(k, kGroup);
  check_part(parts[0], what, 0, "blocks", at::kByte, {e, n, g, kGroupBytes});
  check_part(parts[1], what, 1, "scales", at::kByte, {e, n, g});
}

}  // namespace

// Rows padded to 8 as for INT8 (few rows per expert at small T).
KT_REGISTER_FORMAT(mxfp4, Format{"mxfp4", 2, check_mxfp4, load_mxfp4, 8});

}  // namespace formats
}  // namespace kt_kernel
