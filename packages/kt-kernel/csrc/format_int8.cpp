// The weight-only INT8 format (kt_kernel.formats.Int8PerChannel): parts q int8 [E, N, K] and
// scale fp32 [E, N]; W[n, k] = q[n, k] * scale[n], formed in fp32 and rounded once.
// Per-ISA tile loops (AVX-512 with BF16 conversion, AVX2, scalar), one body compiled per ISA
// under a target pragma; the extension is built without -march=native, so they run only where
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
// out[r * ldo + c] = q[r * ldq + c] * scale[r] for r < rows, c < cols: one loop body
// (int8_dequant_body.h) over a per-ISA vector layer, as the INT4 small-row product does.
using DequantFn = void (*)(const int8_t* q, int64_t ldq, const float* scale, int64_t rows,
                           int64_t cols, void* out, int64_t ldo);

namespace int8_scalar {
struct V {
  using F = float;
  static constexpr int L = 1;
  static F load_q(const int8_t* p) { return static_cast<float>(*p); }
  static F mul(F a, F b) { return a * b; }
  static F set1(float v) { return v; }
  static void store_f32(float* d, F v) { *d = v; }
  static void store_bf16(uint16_t* d, F v) { *d = c10::BFloat16(v).x; }
};
#include "int8_dequant_body.h"
}  // namespace int8_scalar

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace int8_avx512 {
struct V {
  using F = __m512;
  static constexpr int L = 16;
  static F load_q(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static void store_f32(float* d, F v) { _mm512_storeu_ps(d, v); }
};
#include "int8_dequant_body.h"
}  // namespace int8_avx512
#pragma GCC pop_options

// int8 -> int32 (vpmovsxbd) -> fp32 -> * scale -> bf16 (vcvtneps2bf16, round to nearest even).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace int8_avx512bf16 {
struct V : int8_avx512::V {
  static void store_bf16(uint16_t* d, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), (__m256i)_mm512_cvtneps_pbh(v));
  }
};
#include "int8_dequant_body.h"
}  // namespace int8_avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace int8_avx2 {
struct V {
  using F = __m256;
  static constexpr int L = 8;
  static F load_q(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static void store_f32(float* d, F v) { _mm256_storeu_ps(d, v); }
  // fp32 -> bf16 round to nearest even on 8 lanes, as c10::BFloat16 (inputs are finite here).
  static void store_bf16(uint16_t* d, F v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    // pack 8 x u32 (each < 2^16) into 8 x u16 in order
    const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm_packus_epi32(lo, hi));
  }
};
#include "int8_dequant_body.h"
}  // namespace int8_avx2
#pragma GCC pop_options
#endif

struct DequantTable {
  DequantFn f32 = int8_scalar::dequant<false>;
  DequantFn bf16 = int8_scalar::dequant<true>;
  std::string isa = "scalar";
};

DequantTable select_dequant() {
  DequantTable t;
#if defined(__x86_64__) && defined(__GNUC__)
  const Isa level = isa_level();
  if (level == Isa::kAvx512) {
    t.f32 = int8_avx512::dequant<false>;
    // Without AVX512_BF16 the bf16 tiles take AVX2's rounding loop.
    t.bf16 = has_avx512_bf16() ? int8_avx512bf16::dequant<true> : int8_avx2::dequant<true>;
    t.isa = has_avx512_bf16() ? "avx512_bf16" : "avx512";
  } else if (level == Isa::kAvx2) {
    t.f32 = int8_avx2::dequant<false>;
    t.bf16 = int8_avx2::dequant<true>;
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
