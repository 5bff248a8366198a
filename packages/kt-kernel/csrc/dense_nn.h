// The dense bf16 small-row "nn" product (dense_nn.cpp).
#pragma once

#include <cstdint>

namespace kt_kernel {

// out [m, K] = in [m, N] @ W [N, K], all bf16 bits, rows of unit stride (row strides ldi, ldo;
// W contiguous). False (nothing written) where the CPU has no AVX512_BF16, the ISA cap is below
// avx512, or K is not a multiple of 64; the caller then runs its GEMM.
bool dense_bf16_nn(const void* in, int64_t ldi, int64_t m, const void* w, int64_t n, int64_t k,
                   void* out, int64_t ldo);

}  // namespace kt_kernel
