// The weight-only INT8 format (kt_kernel.formats.Int8PerChannel): parts q int8 [E, N, K] and
// scale fp32 [E, N]; W[n, k] = q[n, k] * scale[n], formed in fp32 and rounded once.
// Per-ISA tile loops (AVX-512 with BF16 conversion, AVX2, scalar); the extension is built
// without -march=native, so the SIMD loops carry target attributes and run only where
// isa_level() allows.
#include "formats.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace kt_kernel {
namespace formats {
namespace {

// ---------------------------------------------------------------- dequantisation kernels
// out[r * ldo + c] = q[r * ldq + c] * scale[r] for r < rows, c < cols. The product is formed
// in fp32 and rounded once (to nearest even for bf16), exactly as the Python reference does,
// so every ISA gives bitwise the same tile.
using DequantFn = void (*)(const int8_t* q, int64_t ldq, const float* scale, int64_t rows,
                           int64_t cols, void* out, int64_t ldo);

void dequant_f32_scalar(const int8_t* q, int64_t ldq, const float* scale, int64_t rows,
                        int64_t cols, void* out, int64_t ldo) {
  float* o = static_cast<float*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scale[r];
    for (int64_t c = 0; c < cols; ++c) o[r * ldo + c] = static_cast<float>(q[r * ldq + c]) * s;
  }
}

void dequant_bf16_scalar(const int8_t* q, int64_t ldq, const float* scale, int64_t rows,
                         int64_t cols, void* out, int64_t ldo) {
  c10::BFloat16* o = static_cast<c10::BFloat16*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scale[r];
    for (int64_t c = 0; c < cols; ++c) {
      o[r * ldo + c] = c10::BFloat16(static_cast<float>(q[r * ldq + c]) * s);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define KT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define KT_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

KT_AVX512 inline __m512 load16_ps(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

KT_AVX512 inline __m512 load_tail_ps(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

KT_AVX512 void dequant_f32_avx512(const int8_t* q, int64_t ldq, const float* scale, int64_t rows,
                                  int64_t cols, void* out, int64_t ldo) {
  float* o = static_cast<float*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r]);
    const int8_t* src = q + r * ldq;
    float* dst = o + r * ldo;
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) _mm512_storeu_ps(dst + c, _mm512_mul_ps(load16_ps(src + c), s));
    if (c < cols) {
      const __mmask16 m = static_cast<__mmask16>((1u << (cols - c)) - 1u);
      _mm512_mask_storeu_ps(dst + c, m, _mm512_mul_ps(load_tail_ps(src + c, m), s));
    }
  }
}

// int8 -> int32 (vpmovsxbd) -> fp32 -> * scale -> bf16 (vcvtne2ps2bf16, round to nearest even).
KT_AVX512BF16 void dequant_bf16_avx512(const int8_t* q, int64_t ldq, const float* scale,
                                       int64_t rows, int64_t cols, void* out, int64_t ldo) {
  uint16_t* o = static_cast<uint16_t*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(scale[r]);
    const int8_t* src = q + r * ldq;
    uint16_t* dst = o + r * ldo;
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
      const __m512 lo = _mm512_mul_ps(load16_ps(src + c), s);
      const __m512 hi = _mm512_mul_ps(load16_ps(src + c + 16), s);
      _mm512_storeu_si512(dst + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    for (; c < cols; c += 16) {
      const int64_t left = std::min<int64_t>(16, cols - c);
      const __mmask16 m = static_cast<__mmask16>(left == 16 ? 0xFFFFu : (1u << left) - 1u);
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(load_tail_ps(src + c, m), s));
      _mm256_mask_storeu_epi16(dst + c, m, (__m256i)v);
    }
  }
}

#define KT_AVX2 __attribute__((target("avx2,fma")))

KT_AVX2 inline __m256 load8_ps_avx2(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

KT_AVX2 void dequant_f32_avx2(const int8_t* q, int64_t ldq, const float* scale, int64_t rows,
                              int64_t cols, void* out, int64_t ldo) {
  float* o = static_cast<float*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 s = _mm256_set1_ps(scale[r]);
    const int8_t* src = q + r * ldq;
    float* dst = o + r * ldo;
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(load8_ps_avx2(src + c), s));
    for (; c < cols; ++c) dst[c] = static_cast<float>(src[c]) * scale[r];
  }
}

// fp32 -> bf16 round to nearest even on 8 lanes, as c10::BFloat16 (inputs are finite here).
KT_AVX2 inline __m128i f32_to_bf16_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  // pack 8 x u32 (each < 2^16) into 8 x u16 in order
  const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
  return _mm_packus_epi32(lo, hi);
}

KT_AVX2 void dequant_bf16_avx2(const int8_t* q, int64_t ldq, const float* scale, int64_t rows,
                               int64_t cols, void* out, int64_t ldo) {
  c10::BFloat16* o = static_cast<c10::BFloat16*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 s = _mm256_set1_ps(scale[r]);
    const int8_t* src = q + r * ldq;
    c10::BFloat16* dst = o + r * ldo;
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c),
                       f32_to_bf16_avx2(_mm256_mul_ps(load8_ps_avx2(src + c), s)));
    }
    for (; c < cols; ++c) dst[c] = c10::BFloat16(static_cast<float>(src[c]) * scale[r]);
  }
}

#endif

struct DequantTable {
  DequantFn f32 = dequant_f32_scalar;
  DequantFn bf16 = dequant_bf16_scalar;
  std::string isa = "scalar";
};

DequantTable select_dequant() {
  DequantTable t;
#if defined(__x86_64__) && defined(__GNUC__)
  const Isa level = isa_level();
  if (level == Isa::kAvx512) {
    t.f32 = dequant_f32_avx512;
    t.bf16 = has_avx512_bf16() ? dequant_bf16_avx512 : dequant_bf16_avx2;
    t.isa = has_avx512_bf16() ? "avx512_bf16" : "avx512";
  } else if (level == Isa::kAvx2) {
    t.f32 = dequant_f32_avx2;
    t.bf16 = dequant_bf16_avx2;
    t.isa = "avx2";
  }
#endif
  return t;
}

const DequantTable& dequant_table() {
  static const DequantTable t = select_dequant();
  return t;
}

void load_int8(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows, int64_t cols,
               c10::ScalarType dt, void* out, int64_t ldo) {
  const auto* q = static_cast<const int8_t*>(w.part[0]) + row0 * w.k + col0;
  const auto* scale = static_cast<const float*>(w.part[1]) + row0;
  const auto& t = dequant_table();
  if (dt == c10::ScalarType::BFloat16) {
    t.bf16(q, w.k, scale, rows, cols, out, ldo);
  } else {
    TORCH_CHECK_TYPE(dt == c10::ScalarType::Float,
                     "int8 format: compute dtype must be float32 or bfloat16, got ", dt);
    t.f32(q, w.k, scale, rows, cols, out, ldo);
  }
}

void check_int8(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
                const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 2, what, " (int8) must be 2 tensors (q, scale), got ",
                    parts.size());
  check_part(parts[0], what, 0, "q", at::kChar, {e, n, k});
  check_part(parts[1], what, 1, "scale", at::kFloat, {e, n});
}

}  // namespace

// ISA the INT8 tile loops dispatch to: "avx512_bf16", "avx512", "avx2" or "scalar".
const std::string& int8_isa() { return dequant_table().isa; }

// Rows padded to 8 rather than the dense 16: at small T an expert holds ~8 rows, and padding
// them to 16 measured ~5% slower with dequantised tiles.
KT_REGISTER_FORMAT(int8, Format{"int8", 2, check_int8, load_int8, 8});

}  // namespace formats
}  // namespace kt_kernel
