// Per-ISA INT8 tile dequantisation (see int8_dequant.h). The extension is built without
// -march=native; the AVX-512 loops carry target attributes and run only where CPUID says so.
#include "int8_dequant.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace kt_kernel {
namespace int8 {
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

#endif

struct DequantTable {
  DequantFn f32 = dequant_f32_scalar;
  DequantFn bf16 = dequant_bf16_scalar;
  std::string isa = "scalar";
};

DequantTable select_dequant() {
  DequantTable t;
  // KT_KERNEL_ISA=avx2|scalar caps the choice, as for the elementwise loops (fallback tests).
  const char* cap = std::getenv("KT_KERNEL_ISA");
  const bool allow512 = !cap || std::strcmp(cap, "avx512") == 0;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool f512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (allow512 && f512) {
    t.f32 = dequant_f32_avx512;
    t.isa = "avx512";
    if (__builtin_cpu_supports("avx512bf16")) {
      t.bf16 = dequant_bf16_avx512;
      t.isa = "avx512_bf16";
    }
  }
#endif
  return t;
}

const DequantTable& dequant_table() {
  static const DequantTable t = select_dequant();
  return t;
}

}  // namespace

void dequant(const int8_t* q, int64_t ldq, const float* scale, int64_t rows, int64_t cols,
             c10::ScalarType dt, void* out, int64_t ldo) {
  const auto& t = dequant_table();
  if (dt == c10::ScalarType::BFloat16) {
    t.bf16(q, ldq, scale, rows, cols, out, ldo);
  } else {
    TORCH_CHECK(dt == c10::ScalarType::Float, "int8 base: compute dtype must be float32 or bfloat16, got ", dt);
    t.f32(q, ldq, scale, rows, cols, out, ldo);
  }
}

const std::string& dequant_isa() { return dequant_table().isa; }

}  // namespace int8
}  // namespace kt_kernel
