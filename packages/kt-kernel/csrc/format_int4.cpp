// The weight-only INT4 format (kt_kernel.formats_int4.Int4Grouped), registered once per group
// size G as "int4_g32", "int4_g64" and "int4_g128". Parts per expert:
//   packed uint8 [ceil(N/2), K]: byte [p, k] = (q[2p, k] + 8) | (q[2p+1, k] + 8) << 4,
//   scale  bf16  [N, ceil(K/G)].
// W[n, k] = q[n, k] * scale[n, k / G], formed in fp32 (exact: a 4-bit integer times an
// 8-bit-significand scale) and, for bf16 tiles, rounded once to nearest even. Every ISA path
// computes exactly that, so tiles are bitwise equal to the Python dequantize on every path.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "format_simd.h"
#include "formats.h"

namespace kt_kernel {
namespace formats {
namespace {

// One output row: out[c - col0] = W[n, c] for c in [col0, col0 + cols). `src` is the packed row
// pair holding row n, `shift` 0 (even n) or 4 (odd n), `scale` row n's group scales.
struct RowArgs {
  const uint8_t* src;
  int shift;
  const c10::BFloat16* scale;
  int64_t col0, cols;
  void* out;
};
// `gshift` = log2(G): the group of column c is c >> gshift (G is a power of two; a 64-bit
// division per 16 columns measured as a large part of the loader's time).
using RowFn = void (*)(const RowArgs& a, int gshift);

inline float w_at(const RowArgs& a, int64_t c, int gshift) {
  const int q = static_cast<int>((a.src[c] >> a.shift) & 0xF) - 8;
  return static_cast<float>(q) * static_cast<float>(a.scale[c >> gshift]);
}

void row_f32_scalar(const RowArgs& a, int gshift) {
  float* o = static_cast<float*>(a.out);
  for (int64_t j = 0; j < a.cols; ++j) o[j] = w_at(a, a.col0 + j, gshift);
}

void row_bf16_scalar(const RowArgs& a, int gshift) {
  c10::BFloat16* o = static_cast<c10::BFloat16*>(a.out);
  for (int64_t j = 0; j < a.cols; ++j) o[j] = c10::BFloat16(w_at(a, a.col0 + j, gshift));
}

#ifdef KT_FMT_SIMD
// Columns before the first multiple of 16 (col0 is one in every call the op makes) go through
// the scalar path; from there every 16-column unit lies inside one group (G % 16 == 0).
inline int64_t head_cols(const RowArgs& a) {
  return std::min(a.cols, (16 - a.col0 % 16) % 16);
}

// 16 packed bytes (or the first `m` of them) -> 16 fp32 weights of one group.
KT_FMT_AVX512 inline __m512 unit16_avx512(const uint8_t* p, __mmask16 m, __m128i shift,
                                          __m512 s) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
  v = _mm512_and_si512(_mm512_srl_epi32(v, shift), _mm512_set1_epi32(0xF));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(8))), s);
}

// One row on AVX-512. STORE(j, m, w) writes the 16 (masked: m) weights w at output column j;
// a macro rather than a template so each variant carries only the target features it uses.
#define KT_INT4_ROW_AVX512(NAME, ATTR, SCALAR, STORE)                                    \
  ATTR void NAME(const RowArgs& a, int gshift) {                                        \
    const int64_t head = head_cols(a);                                                     \
    if (head > 0) {                                                                        \
      RowArgs h = a;                                                                       \
      h.cols = head;                                                                       \
      SCALAR(h, gshift);                                                                    \
    }                                                                                      \
    const __m128i shift = _mm_cvtsi32_si128(a.shift);                                      \
    for (int64_t j = head; j < a.cols; j += 16) {                                          \
      const int64_t c = a.col0 + j;                                                        \
      const int64_t left = std::min<int64_t>(16, a.cols - j);                              \
      const __mmask16 m = static_cast<__mmask16>(left == 16 ? 0xFFFFu : (1u << left) - 1u); \
      const __m512 s = _mm512_set1_ps(static_cast<float>(a.scale[c >> gshift]));             \
      const __m512 w = unit16_avx512(a.src + c, m, shift, s);                              \
      STORE(j, m, w);                                                                      \
    }                                                                                      \
  }


KT_INT4_ROW_AVX512(row_f32_avx512, KT_FMT_AVX512, row_f32_scalar, KT_STORE_F32)
KT_INT4_ROW_AVX512(row_bf16_avx512bf16, KT_FMT_AVX512BF16, row_bf16_scalar, KT_STORE_BF16_NATIVE)
// Without AVX512_BF16 (Skylake-X, Ice Lake): the same rounding done with integer ops.
KT_INT4_ROW_AVX512(row_bf16_avx512, KT_FMT_AVX512, row_bf16_scalar, KT_STORE_BF16_INT)

// 8 packed bytes -> 8 fp32 weights of one group.
KT_FMT_AVX2 inline __m256 unit8_avx2(const uint8_t* p, __m128i shift, __m256 s) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  v = _mm256_and_si256(_mm256_srl_epi32(v, shift), _mm256_set1_epi32(0xF));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8))), s);
}

template <bool Bf16>
KT_FMT_AVX2 void row_avx2_impl(const RowArgs& a, int gshift) {
  const int64_t head = head_cols(a);
  const int64_t body = head + (a.cols - head) / 8 * 8;
  const __m128i shift = _mm_cvtsi32_si128(a.shift);
  for (int64_t j = head; j < body; j += 8) {
    const int64_t c = a.col0 + j;
    const __m256 w =
        unit8_avx2(a.src + c, shift, _mm256_set1_ps(static_cast<float>(a.scale[c >> gshift])));
    simd::store8_avx2<Bf16>(a.out, j, w);
  }
  const auto scalar = [&](const RowArgs& r) {
    if (Bf16) {
      row_bf16_scalar(r, gshift);
    } else {
      row_f32_scalar(r, gshift);
    }
  };
  simd::scalar_cols<Bf16>(a, 0, head, scalar);
  simd::scalar_cols<Bf16>(a, body, a.cols, scalar);
}

KT_FMT_AVX2 void row_f32_avx2(const RowArgs& a, int gshift) { row_avx2_impl<false>(a, gshift); }
KT_FMT_AVX2 void row_bf16_avx2(const RowArgs& a, int gshift) { row_avx2_impl<true>(a, gshift); }
#endif

const RowFns<RowFn>& rows_table() {
  static const RowFns<RowFn> t = pick_rows<RowFn>({row_f32_scalar, row_bf16_scalar,
#ifdef KT_FMT_SIMD
                                                   row_f32_avx2, row_bf16_avx2, row_f32_avx512,
                                                   row_bf16_avx512, row_bf16_avx512bf16
#endif
  });
  return t;
}

template <int G>
void load_int4(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows, int64_t cols,
               c10::ScalarType dt, void* out, int64_t ldo) {
  TORCH_CHECK_TYPE(dt == c10::ScalarType::Float || dt == c10::ScalarType::BFloat16,
                   "int4 format: compute dtype must be float32 or bfloat16, got ", dt);
  const auto* packed = static_cast<const uint8_t*>(w.part[0]);
  const auto* scale = static_cast<const c10::BFloat16*>(w.part[1]);
  static_assert(G > 0 && (G & (G - 1)) == 0, "the int4 group size must be a power of two");
  constexpr int kShift = __builtin_ctz(G);
  const int64_t groups = (w.k + G - 1) / G;
  const bool bf16 = dt == c10::ScalarType::BFloat16;
  const RowFn fn = bf16 ? rows_table().bf16 : rows_table().f32;
  const size_t esize = bf16 ? 2 : 4;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = row0 + r;
    RowArgs a{packed + (n >> 1) * w.k, static_cast<int>(n & 1) * 4, scale + n * groups, col0,
              cols, static_cast<char*>(out) + static_cast<size_t>(r * ldo) * esize};
    fn(a, kShift);
  }
}

template <int G>
void check_int4(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
                const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 2, what, " (int4_g", G,
                    ") must be 2 tensors (packed, scale), got ", parts.size());
  check_part(parts[0], what, 0, "packed", at::kByte, {e, (n + 1) / 2, k});
  check_part(parts[1], what, 1, "scale", at::kBFloat16, {e, n, (k + G - 1) / G});
}

}  // namespace

// Rows padded to 8 as for INT8 (few rows per expert at small T).
KT_REGISTER_FORMAT(int4_g32, Format{"int4_g32", 2, check_int4<32>, load_int4<32>, 8});
KT_REGISTER_FORMAT(int4_g64, Format{"int4_g64", 2, check_int4<64>, load_int4<64>, 8});
KT_REGISTER_FORMAT(int4_g128, Format{"int4_g128", 2, check_int4<128>, load_int4<128>, 8});

}  // namespace formats
}  // namespace kt_kernel
