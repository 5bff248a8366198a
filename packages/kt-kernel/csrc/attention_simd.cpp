// Per-ISA code of the causal attention op: the row passes (attention_rows_body.h, compiled for
// AVX-512 and for baseline x86-64) and the bf16 GEMM micro-kernel on AVX512_BF16's vdpbf16ps.
// Why a GEMM of our own: ATen's bf16 matmul (oneDNN) only writes bf16, and the bf16 x bf16 ->
// fp32 GEMMs torch exposes (MKL's, cpublas) run at under half the bf16 peak on AMD CPUs; the
// scores must stay fp32 for the softmax.
#include "attention.h"
#include "formats.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kt_kernel {
namespace attention {

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,bmi2")
namespace isa_avx512 {
#include "attention_rows_body.h"

// One MR x 32 tile of C: 2 x MR accumulators of 16 floats; per pair of k, two loads of B and
// MR broadcasts of A's pair, each feeding two vdpbf16ps. mask0/mask1 cut the columns at N.
template <int MR>
static inline void tile(int64_t k2, const uint16_t* A, int64_t lda, const uint16_t* B,
                        int64_t ldb, float* C, int64_t ldc, bool accumulate, __mmask16 mask0,
                        __mmask16 mask1) {
  __m512 c0[MR], c1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    if (accumulate) {
      c0[r] = _mm512_maskz_loadu_ps(mask0, C + r * ldc);
      c1[r] = _mm512_maskz_loadu_ps(mask1, C + r * ldc + 16);
    } else {
      c0[r] = _mm512_setzero_ps();
      c1[r] = _mm512_setzero_ps();
    }
  }
  const int32_t* b = reinterpret_cast<const int32_t*>(B);
  for (int64_t kp = 0; kp < k2; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(mask0, b + kp * ldb);
    const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(mask1, b + kp * ldb + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * kp, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(C + r * ldc, mask0, c0[r]);
    _mm512_mask_storeu_ps(C + r * ldc + 16, mask1, c1[r]);
  }
}

static void gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                      const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  const int64_t k2 = (K + 1) / 2;
  constexpr int kMr = 8;
  // Column strips outside, row tiles inside: a strip of B (k2 x 32 pairs) stays in L1 while
  // every row tile of A passes over it.
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    const int64_t nn = std::min<int64_t>(32, N - n0);
    const __mmask16 mask0 = static_cast<__mmask16>((1u << std::min<int64_t>(16, nn)) - 1u);
    const __mmask16 mask1 =
        static_cast<__mmask16>((1u << std::max<int64_t>(0, nn - 16)) - 1u);
    const uint16_t* b = B + 2 * n0;
    for (int64_t m0 = 0; m0 < M; m0 += kMr) {
      const uint16_t* a = A + m0 * lda;
      float* c = C + m0 * ldc + n0;
      switch (std::min<int64_t>(kMr, M - m0)) {
        case 8: tile<8>(k2, a, lda, b, ldb, c, ldc, accumulate, mask0, mask1); break;
        case 7: tile<7>(k2, a, lda, b, ldb, c, ldc, accumulate, mask0, mask1); break;
        case 6: tile<6>(k2, a, lda, b, ldb, c, ldc, accumulate, mask0, mask1); break;
        case 5: tile<5>(k2, a, lda, b, ldb, c, ldc, accumulate, mask0, mask1); break;
        case 4: tile<4>(k2, a, lda, b, ldb, c, ldc, accumulate, mask0, mask1); break;
        case 3: tile<3>(k2, a, lda, b, ldb, c, ldc, accumulate, mask0, mask1); break;
        case 2: tile<2>(k2, a, lda, b, ldb, c, ldc, accumulate, mask0, mask1); break;
        default: tile<1>(k2, a, lda, b, ldb, c, ldc, accumulate, mask0, mask1); break;
      }
    }
  }
}
}  // namespace isa_avx512
#pragma GCC pop_options
#endif

namespace isa_base {
#include "attention_rows_body.h"
}  // namespace isa_base

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa_level() == Isa::kAvx512) {
    isa_avx512::gemm_loops<float>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
    return;
  }
#endif
  isa_base::gemm_loops<float>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

void gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (has_avx512_bf16()) {
    isa_avx512::gemm_bf16(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
    return;
  }
#endif
  isa_base::gemm_loops<uint16_t>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

const char* gemm_isa() { return has_avx512_bf16() ? "avx512_bf16" : "portable"; }

static Rows select_rows() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa_level() == Isa::kAvx512) {
    return Rows{{&isa_avx512::fwd_row<float>, &isa_avx512::bwd_row<float>},
                {&isa_avx512::fwd_row<uint16_t>, &isa_avx512::bwd_row<uint16_t>}};
  }
#endif
  return Rows{{&isa_base::fwd_row<float>, &isa_base::bwd_row<float>},
              {&isa_base::fwd_row<uint16_t>, &isa_base::bwd_row<uint16_t>}};
}

const Rows& rows() {
  static const Rows table = select_rows();
  return table;
}

}  // namespace attention
}  // namespace kt_kernel
