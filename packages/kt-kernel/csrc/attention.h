// The two building blocks of the causal attention op (attention.cpp), compiled per ISA in
// attention_simd.cpp: a small GEMM with fp32 accumulation over "pair-packed" operands, and
// the fused softmax row passes over one cache-resident block of scores.
#pragma once
#include <cstdint>

namespace kt_kernel {
namespace attention {

// C[M, N] = (accumulate ? C : 0) + A[M, K] B[K, N], accumulated in fp32.
//  - A is row-major with row stride lda; when K is odd its column K must be readable and
//    finite (the buffers here keep a zero pad column).
//  - B is pair-packed with row stride ldb: element (k, n) lies at B[2 * ((k / 2) * ldb + n) +
//    k % 2], so the two k of a pair sit side by side as AVX512_BF16's dot product wants them;
//    when K is odd, pair K / 2's second half must be finite and is multiplied by A's zero pad.
// bf16 (raw bits) runs on AMX tiles where the CPU and OS allow them (KT_KERNEL_AMX=0: not),
// on vdpbf16ps where the CPU has AVX512_BF16, and in portable loops elsewhere.
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate);
void gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate);

// The softmax passes over one row of a block of scores s (fp32, N keys of which the first nv
// are visible to the row's query; the rest are causally masked):
//  fwd: online softmax. With m, l the row's running max (scaled units) and sum: update both,
//       write p[c] = exp(scale s[c] - m) for c < nv and 0 up to n_pad, and rescale the row's
//       output accumulator o[0, d) by exp(m_old - m_new).
//  bwd: p = exp(scale s - lse), ds = scale p (dp - delta); p goes to p_pair[2c] (pair-packed
//       by query row), ds to ds_row[c] (zero up to n_pad) and ds_pair[2c]; masked keys get 0.
template <typename S>
struct RowFns {
  void (*fwd)(const float* s, int64_t nv, int64_t n_pad, float scale, float* m, float* l, S* p,
              float* o, int64_t d);
  void (*bwd)(const float* s, const float* dp, int64_t nv, int64_t n, int64_t n_pad,
              float scale, float lse, float delta, S* p_pair, S* ds_row, S* ds_pair);
};
struct Rows {
  RowFns<float> f32;
  RowFns<uint16_t> bf16;
};
const Rows& rows();

// Which GEMM the bf16 path runs: "amx_bf16", "avx512_bf16" or "portable".
const char* gemm_isa();

}  // namespace attention
}  // namespace kt_kernel
