// Dequantisation of weight-only INT8 tiles (per-row fp32 scale) into fp32 or bf16, compiled
// per ISA with function-level target attributes and picked at run time from CPUID.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace kt_kernel {
namespace int8 {

// out[r * ldo + c] = q[r * ldq + c] * scale[r] for r < rows, c < cols, in `dt` (fp32 or bf16).
void dequant(const int8_t* q, int64_t ldq, const float* scale, int64_t rows, int64_t cols,
             c10::ScalarType dt, void* out, int64_t ldo);

// "avx512_bf16", "avx512" or "scalar": what dequant() dispatches to (KT_KERNEL_ISA caps it).
const std::string& dequant_isa();

}  // namespace int8
}  // namespace kt_kernel
