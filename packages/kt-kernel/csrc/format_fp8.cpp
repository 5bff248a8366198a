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
#include <vector>

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

// ------------------------------------------------------------------ small-row product
// bf16 compute on AVX512_BF16 only (elsewhere it declines and the op takes tile + GEMM): the
// E4M3 bytes decoded in registers (unit16_avx512: the tile loader's values, rounded to bf16
// by vcvtne2ps2bf16 as the loader rounds them) and vdpbf16ps into the few rows, as INT4's
// bf16 path does (gemv_avx512bf16, format_int4.cpp): weight rows in pairs, 32 columns per step
// (inside one 128-column block). Every bf16 x bf16 product is exact in fp32, so the result is
// the tile + GEMM one up to the order of the fp32 sums (test_gemv checks that order bitwise).
#ifdef KT_FMT_SIMD
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace gemv_bf16 {

struct Fp8Mat {
  const uint8_t* w;
  const float* scale;
  int64_t n, k, kb;  // kb: blocks per row of scale_inv
};

inline void put_bf16(void* out, int64_t ld, int64_t r, int64_t c, float v) {
  static_cast<c10::BFloat16*>(out)[r * ld + c] = c10::BFloat16(v);
}

// 32 bytes of row `src` from column c (a zero-padded copy at the tail) -> 32 bf16 weights,
// each the tile loader's value: E4M3 times the block's scale in fp32, rounded once to bf16.
// Cheaper than unit16_avx512: each byte is widened to a fp16 bit pattern (sign, exponent and
// mantissa moved into fp16's fields; fp16's bias of 15 against E4M3's 7 makes it exactly 2^-8
// of the E4M3 value, subnormals included) and vcvtph2ps converts it exactly; s256 = s * 2^8
// (exact: gemv_fp8 declines scales that would overflow) restores the scale, so the product is
// the loader's, rounded once. 0x7F and 0xFF (NaN) become a fp16 NaN.
inline __m512bh row32(const uint8_t* src, int64_t c, int64_t k, __m512 s256) {
  const uint8_t* p = src + c;
  uint8_t tail[32];
  if (c + 32 > k) {
    std::memset(tail, 0, sizeof(tail));  // E4M3 0x00: +0
    std::memcpy(tail, p, static_cast<size_t>(k - c));
    p = tail;
  }
  // sign-extended: bits 0-6 the magnitude, 7-15 the sign
  const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  // << 7: magnitude to bits 7-13 (fp16 exponent bits 10-13, mantissa 7-9), sign to 14 and 15;
  // bit 14 (the fp16 exponent's top bit) cleared
  __m512i h =
      _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
  h = _mm512_mask_mov_epi16(h, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F)),
                            _mm512_set1_epi16(0x7E00));
  const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s256);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s256);
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// out[r0 + r, n] = sum_c x[r, c] W[n, c]; x bf16 [MB, k rounded up to 32], zero-padded.
template <int MB>
void nt_block(const Fp8Mat& g, const uint16_t* x, int64_t ldx, void* out, int64_t ldo,
              int64_t r0) {
  for (int64_t n0 = 0; n0 < g.n; n0 += 2) {
    const bool two = n0 + 1 < g.n;
    const uint8_t* src0 = g.w + n0 * g.k;
    const uint8_t* src1 = two ? src0 + g.k : src0;  // an odd N's last row: a1 is dropped
    const float* sc = g.scale + (n0 / kBlock) * g.kb;  // n0 even: both rows in one block row
    __m512 a0[MB], a1[MB];
    for (int r = 0; r < MB; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < g.k; c += 32) {
      const __m512 s = _mm512_set1_ps(sc[c / kBlock] * 256.0f);
      const __m512bh b0 = row32(src0, c, g.k, s);
      const __m512bh b1 = row32(src1, c, g.k, s);
#pragma GCC unroll 16
      for (int r = 0; r < MB; ++r) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + c);
        a0[r] = _mm512_dpbf16_ps(a0[r], b0, xv);
        a1[r] = _mm512_dpbf16_ps(a1[r], b1, xv);
      }
    }
    for (int r = 0; r < MB; ++r) {
      put_bf16(out, ldo, r0 + r, n0, _mm512_reduce_add_ps(a0[r]));
      if (two) put_bf16(out, ldo, r0 + r, n0 + 1, _mm512_reduce_add_ps(a1[r]));
    }
  }
}

// acc[r, c] += sum_n x[r, n] W[n, c]; x bf16 [MB, N rounded up to 2] (zero-padded), acc fp32
// [MB, lda], lda a multiple of 32. Rows in blocks of 32 (16 pairs) so their cache lines stay
// in L1 while the 32-byte halves are read in turn (rows lie K apart).
template <int MB>
void nn_block(const Fp8Mat& g, const uint16_t* x, int64_t ldx, float* acc, int64_t lda) {
  constexpr int64_t kRowBlock = 32;
  // word 2j <- r0[j], word 2j + 1 <- r1[j] (index 32 + j: the second source)
  const __m512i interleave =
      _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                       6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int64_t b0 = 0; b0 < g.n; b0 += kRowBlock) {
    const int64_t b1 = std::min(g.n, b0 + kRowBlock);
    for (int64_t c = 0; c < g.k; c += 32) {
      __m512 a[MB], b[MB];
      for (int r = 0; r < MB; ++r) {
        a[r] = _mm512_loadu_ps(acc + r * lda + c);
        b[r] = _mm512_loadu_ps(acc + r * lda + c + 16);
      }
      for (int64_t n0 = b0; n0 < b1; n0 += 2) {
        const uint8_t* src0 = g.w + n0 * g.k;
        // an odd N's last row: its partner's input column is zero (x is padded)
        const uint8_t* src1 = n0 + 1 < g.n ? src0 + g.k : src0;
        const __m512 s = _mm512_set1_ps(g.scale[(n0 / kBlock) * g.kb + c / kBlock] * 256.0f);
        const __m512bh r0 = row32(src0, c, g.k, s);  // words: columns c..c+31 of row n0
        const __m512bh r1 = row32(src1, c, g.k, s);
        // (n0, n0 + 1) interleaved per column: low 16 columns, then high 16
        const __m512i lo = _mm512_permutex2var_epi16((__m512i)r0, interleave, (__m512i)r1);
        const __m512i hi = _mm512_permutex2var_epi16(
            (__m512i)r0, _mm512_add_epi16(interleave, _mm512_set1_epi16(16)), (__m512i)r1);
#pragma GCC unroll 16
        for (int r = 0; r < MB; ++r) {
          int32_t xp;
          std::memcpy(&xp, x + r * ldx + n0, 4);
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
          a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)lo, xv);
          b[r] = _mm512_dpbf16_ps(b[r], (__m512bh)hi, xv);
        }
      }
      for (int r = 0; r < MB; ++r) {
        _mm512_storeu_ps(acc + r * lda + c, a[r]);
        _mm512_storeu_ps(acc + r * lda + c + 16, b[r]);
      }
    }
  }
}

void nt(const Fp8Mat& g, const uint16_t* x, int64_t ldx, int64_t m, void* out, int64_t ldo) {
  for_row_blocks<8>(m, [&]<int R>(int64_t r0) {
    nt_block<R>(g, x + r0 * ldx, ldx, out, ldo, r0);
  });
}

void nn(const Fp8Mat& g, const uint16_t* x, int64_t ldx, int64_t m, float* acc, int64_t lda) {
  for_row_blocks<8>(m, [&]<int R>(int64_t r0) {
    nn_block<R>(g, x + r0 * ldx, ldx, acc + r0 * lda, lda);
  });
}

}  // namespace gemv_bf16
#pragma GCC pop_options
#endif

bool gemv_fp8(const ExpertView& w, bool nn, const void* in, int64_t ldi, int64_t m,
              c10::ScalarType dt, void* out, int64_t ldo) {
#ifdef KT_FMT_SIMD
  if (dt != c10::ScalarType::BFloat16 || !has_avx512_bf16()) return false;
  const gemv_bf16::Fp8Mat g{static_cast<const uint8_t*>(w.part[0]),
                            static_cast<const float*>(w.part[1]), w.n, w.k,
                            (w.k + kBlock - 1) / kBlock};
  // row32 scales by s * 2^8: decline a (finite) scale where that would overflow (never one
  // of a real checkpoint: amax / 448 of finite fp32 weights stays below 2^120).
  const int64_t nscale = (w.n + kBlock - 1) / kBlock * g.kb;
  for (int64_t i = 0; i < nscale; ++i) {
    if (std::fabs(g.scale[i]) >= 0x1p119f && std::isfinite(g.scale[i])) return false;
  }
  thread_local std::vector<uint16_t> xbuf;
  thread_local std::vector<float> abuf;
  const int64_t k32 = (w.k + 31) / 32 * 32;
  if (!nn) {
    gemv_bf16::nt(g, rows_bf16(in, ldi, m, w.k, k32, xbuf), k32, m, out, ldo);
    return true;
  }
  const int64_t npad = (w.n + 1) / 2 * 2;
  abuf.assign(static_cast<size_t>(m * k32), 0.0f);
  gemv_bf16::nn(g, rows_bf16(in, ldi, m, w.n, npad, xbuf), npad, m, abuf.data(), k32);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < w.k; ++c) gemv_bf16::put_bf16(out, ldo, r, c, abuf[r * k32 + c]);
  }
  return true;
#else
  return false;
#endif
}

void check_fp8(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
               const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 2, what, " (fp8) must be 2 tensors (weight, scale_inv), got ",
                    parts.size());
  TORCH_CHECK_VALUE(n >= 0 && k >= 0, what, " (fp8): n and k must be >= 0, got ", n, " and ", k);
  check_part(parts[0], what, 0, "weight", at::kFloat8_e4m3fn, {e, n, k});
  check_part(parts[1], what, 1, "scale_inv", at::kFloat,
             {e, ceil_div(n, kBlock), ceil_div(k, kBlock)});
}

}  // namespace

// Rows padded to 8 as for INT8 (few rows per expert at small T).
KT_REGISTER_FORMAT(fp8, Format{"fp8", 2, check_fp8, load_fp8, 8, gemv_fp8});

}  // namespace formats
}  // namespace kt_kernel
