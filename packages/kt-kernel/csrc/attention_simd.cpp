// Per-ISA code of the causal attention op: the row passes (attention_rows_body.h, compiled for
// AVX-512 and for baseline x86-64) and the bf16 GEMM micro-kernel on AVX512_BF16's vdpbf16ps.
// Why a GEMM of our own: ATen's bf16 matmul (oneDNN) only writes bf16, and the bf16 x bf16 ->
// fp32 GEMMs torch exposes (MKL's, cpublas) run at under half the bf16 peak on AMD CPUs; the
// scores must stay fp32 for the softmax.
#include "attention.h"
#include "amx_tiles.h"
#include "formats.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
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
      with_rows<kMr>(std::min<int64_t>(kMr, M - m0), [&](auto mr) {
        tile<decltype(mr)::value>(k2, a, lda, b, ldb, c, ldc, accumulate, mask0, mask1);
      });
    }
  }
}
}  // namespace isa_avx512
#pragma GCC pop_options
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// AMX (Sapphire Rapids and later): the same pair-packed B is AMX-BF16's B-tile layout (16
// pairs of k by 16 columns a tile row), and row-major A and fp32 C are its A and C tiles. On
// such CPUs torch's own bf16 matmuls (oneDNN) already run on AMX at about 4x vdpbf16ps's rate
// per core, which left this op's products as the slowest part of a training step.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,bmi2")
namespace isa_amx {

// The 32-aligned part of C (M32 x N32, over K32) on AMX; the caller does the edges.
static void blocks(int64_t M32, int64_t N32, int64_t K32, const uint16_t* A, int64_t lda,
                   const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  // Per call: other code on this thread (oneDNN) loads its own configuration.
  _tile_loadconfig(&tile_config_16x64());
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;  // row strides in bytes
  for (int64_t n0 = 0; n0 < N32; n0 += 32) {
    for (int64_t m0 = 0; m0 < M32; m0 += 32) {
      float* c = C + m0 * ldc + n0;
      if (accumulate) {
        _tile_loadd(0, c, sc);
        _tile_loadd(1, c + 16, sc);
        _tile_loadd(2, c + 16 * ldc, sc);
        _tile_loadd(3, c + 16 * ldc + 16, sc);
      } else {
        tiles_zero();
      }
      const uint16_t* a = A + m0 * lda;
      for (int64_t k0 = 0; k0 < K32; k0 += 32) {
        const uint16_t* b = B + 2 * ((k0 / 2) * ldb + n0);
        tile_step(a + k0, sa, a + 16 * lda + k0, sa, b, b + 32, sb);
      }
      _tile_stored(0, c, sc);
      _tile_stored(1, c + 16, sc);
      _tile_stored(2, c + 16 * ldc, sc);
      _tile_stored(3, c + 16 * ldc + 16, sc);
    }
  }
  _tile_release();  // no tile state left for the kernel to save at a context switch
}

static void gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                      const uint16_t* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  const int64_t M32 = M / 32 * 32, N32 = N / 32 * 32, K32 = K / 32 * 32;
  if (M32 == 0 || N32 == 0 || K32 == 0) {
    isa_avx512::gemm_bf16(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
    return;
  }
  blocks(M32, N32, K32, A, lda, B, ldb, C, ldc, accumulate);
  if (K32 < K) {  // the rest of k for the aligned block (K32 is even: pairs stay whole)
    isa_avx512::gemm_bf16(M32, N32, K - K32, A + K32, lda, B + K32 * ldb, ldb, C, ldc, true);
  }
  if (N32 < N) {  // the columns right of the block, every row
    isa_avx512::gemm_bf16(M, N - N32, K, A, lda, B + 2 * N32, ldb, C + N32, ldc, accumulate);
  }
  if (M32 < M) {  // the rows below the block
    isa_avx512::gemm_bf16(M - M32, N32, K, A + M32 * lda, lda, B, ldb, C + M32 * ldc, ldc,
                          accumulate);
  }
}
}  // namespace isa_amx
#pragma GCC pop_options
#endif  // AMX: kt_kernel::has_amx() (formats.h) says where it runs

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
  if (has_amx()) {
    isa_amx::gemm_bf16(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
    return;
  }
  if (has_avx512_bf16()) {
    isa_avx512::gemm_bf16(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
    return;
  }
#endif
  isa_base::gemm_loops<uint16_t>(M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

const char* gemm_isa() {
  return has_amx() ? "amx_bf16" : has_avx512_bf16() ? "avx512_bf16" : "portable";
}

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
