// The FP8-block format (kt_kernel.formats_fp8.Fp8Block), the layout DeepSeek-V3/R1 and Kimi-K2
// ship. Parts per expert:
//   weight    float8_e4m3fn [N, K],
//   scale_inv float32       [ceil(N/128), ceil(K/128)].
// W[n, k] = float(weight[n, k]) * scale_inv[n / 128, k / 128]: the E4M3 value is exact in fp32,
// the product is rounded once (IEEE multiply) and, for bf16 tiles, once more to nearest even.
// Every ISA path computes exactly that, so tiles are bitwise equal to the Python dequantize.
//
// E4M3 (fn): sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities, NaN = S.1111.111.
// Decoding builds the fp32 bit pattern directly (exponent + 120) for normal values and
// converts the mantissa (x 2^-9) for subnormals, so no fp32 denormal is ever formed (a
// process with denormals-are-zero set still decodes exactly).
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "format_simd.h"
#include "formats.h"

namespace kt_kernel {
namespace formats {
namespace {

constexpr int64_t kBlock = 128;

float decode_e4m3(uint8_t b) {
  const uint32_t mag = b & 0x7F, sign = static_cast<uint32_t>(b & 0x80) << 24;
  if (mag == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  float v;
  if (mag < 8) {
    v = static_cast<float>(mag) * 0.001953125f;  // subnormal: m * 2^-9
  } else {
    const uint32_t bits = (mag << 20) + (120u << 23);
    std::memcpy(&v, &bits, 4);
  }
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u |= sign;
  std::memcpy(&v, &u, 4);
  return v;
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int i = 0; i < 256; ++i) a[i] = decode_e4m3(static_cast<uint8_t>(i));
    return a;
  }();
  return t;
}

// One output row: out[j] = W[n, col0 + j] for j < cols; `src` is row n of the weight and
// `scale` its block row of scale_inv.
struct RowArgs {
  const uint8_t* src;
  const float* scale;
  int64_t col0, cols;
  void* out;
};
using RowFn = void (*)(const RowArgs& a);

void row_f32_scalar(const RowArgs& a) {
  const auto& t = e4m3_table();
  float* o = static_cast<float*>(a.out);
  for (int64_t j = 0; j < a.cols; ++j) {
    const int64_t c = a.col0 + j;
    o[j] = t[a.src[c]] * a.scale[c / kBlock];
  }
}

void row_bf16_scalar(const RowArgs& a) {
  const auto& t = e4m3_table();
  c10::BFloat16* o = static_cast<c10::BFloat16*>(a.out);
  for (int64_t j = 0; j < a.cols; ++j) {
    const int64_t c = a.col0 + j;
    o[j] = c10::BFloat16(t[a.src[c]] * a.scale[c / kBlock]);
  }
}

#ifdef KT_FMT_SIMD
inline int64_t head_cols(const RowArgs& a) { return std::min(a.cols, (16 - a.col0 % 16) % 16); }

// 16 E4M3 bytes (the first of them selected by m) -> 16 fp32 values, times s.
KT_FMT_AVX512 inline __m512 unit16_avx512(const uint8_t* p, __mmask16 m, __m512 s) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  __m512 v = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __mmask16 sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  v = _mm512_mask_mul_ps(v, sub, _mm512_cvtepi32_ps(mag), _mm512_set1_ps(0.001953125f));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
  v = _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
  return _mm512_mul_ps(v, s);
}

// One row on AVX-512; STORE(j, m, w) writes 16 (masked) weights at output column j. A macro
// rather than a template so each variant carries only the target features it uses.
#define KT_FP8_ROW_AVX512(NAME, ATTR, SCALAR, STORE)                                       \
  ATTR void NAME(const RowArgs& a) {                                                         \
    const int64_t head = head_cols(a);                                                       \
    if (head > 0) {                                                                          \
      RowArgs h = a;                                                                         \
      h.cols = head;                                                                         \
      SCALAR(h);                                                                             \
    }                                                                                        \
    for (int64_t j = head; j < a.cols; j += 16) {                                            \
      const int64_t c = a.col0 + j;                                                          \
      const int64_t left = std::min<int64_t>(16, a.cols - j);                                \
      const __mmask16 m = static_cast<__mmask16>(left == 16 ? 0xFFFFu : (1u << left) - 1u);   \
      const __m512 w = unit16_avx512(a.src + c, m, _mm512_set1_ps(a.scale[c / kBlock]));     \
      STORE(j, m, w);                                                                        \
    }                                                                                        \
  }


KT_FP8_ROW_AVX512(row_f32_avx512, KT_FMT_AVX512, row_f32_scalar, KT_STORE_F32)
KT_FP8_ROW_AVX512(row_bf16_avx512bf16, KT_FMT_AVX512BF16, row_bf16_scalar, KT_STORE_BF16_NATIVE)
// Without AVX512_BF16 (Skylake-X, Ice Lake): the same rounding done with integer ops.
KT_FP8_ROW_AVX512(row_bf16_avx512, KT_FMT_AVX512, row_bf16_scalar, KT_STORE_BF16_INT)

// 8 E4M3 bytes -> 8 fp32 values, times s.
KT_FMT_AVX2 inline __m256 unit8_avx2(const uint8_t* p, __m256 s) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subn = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0.001953125f));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  __m256 v = _mm256_blendv_ps(normal, subn, is_sub);
  const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
  v = _mm256_blendv_ps(v, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), is_nan);
  v = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
  return _mm256_mul_ps(v, s);
}

template <bool Bf16>
KT_FMT_AVX2 void row_avx2_impl(const RowArgs& a) {
  const int64_t head = head_cols(a);
  const int64_t body = head + (a.cols - head) / 8 * 8;
  for (int64_t j = head; j < body; j += 8) {
    const int64_t c = a.col0 + j;
    const __m256 w = unit8_avx2(a.src + c, _mm256_set1_ps(a.scale[c / kBlock]));
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

void load_fp8(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows, int64_t cols,
              c10::ScalarType dt, void* out, int64_t ldo) {
  TORCH_CHECK_TYPE(dt == c10::ScalarType::Float || dt == c10::ScalarType::BFloat16,
                   "fp8 format: compute dtype must be float32 or bfloat16, got ", dt);
  const auto* weight = static_cast<const uint8_t*>(w.part[0]);
  const auto* scale = static_cast<const float*>(w.part[1]);
  const int64_t kb = (w.k + kBlock - 1) / kBlock;
  const bool bf16 = dt == c10::ScalarType::BFloat16;
  const RowFn fn = bf16 ? rows_table().bf16 : rows_table().f32;
  const size_t esize = bf16 ? 2 : 4;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = row0 + r;
    RowArgs a{weight + n * w.k, scale + (n / kBlock) * kb, col0, cols,
              static_cast<char*>(out) + static_cast<size_t>(r * ldo) * esize};
    fn(a);
  }
}

void check_fp8(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
               const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 2, what, " (fp8) must be 2 tensors (weight, scale_inv), got ",
                    parts.size());
  check_part(parts[0], what, 0, "weight", at::kFloat8_e4m3fn, {e, n, k});
  check_part(parts[1], what, 1, "scale_inv", at::kFloat,
             {e, (n + kBlock - 1) / kBlock, (k + kBlock - 1) / kBlock});
}

}  // namespace

// Rows padded to 8 as for INT8 (few rows per expert at small T).
KT_REGISTER_FORMAT(fp8, Format{"fp8", 2, check_fp8, load_fp8, 8});

}  // namespace formats
}  // namespace kt_kernel
