// kt_kernel::all_finite: whether a float tensor holds no NaN and no inf, read once from its bits.
// A load-time check of every checkpoint tensor (moe-experts calls it on each chunk right after
// reading it, while the chunk is in cache), so it must run at cache bandwidth: an exponent-bits
// test on the raw integers, no temporaries, no float arithmetic (torch's bf16 sum converts every
// element and reaches about a fifth of this). Compiled per ISA like elementwise.cpp.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdint>

#include "formats.h"

namespace kt_kernel {
namespace {

struct FiniteKernels {
  bool (*u8)(const uint8_t*, int64_t, uint8_t);
  bool (*u16)(const uint16_t*, int64_t, uint16_t);
  bool (*u32)(const uint32_t*, int64_t, uint32_t);
  bool (*u64)(const uint64_t*, int64_t, uint64_t);
  const char* isa;
};

#define KT_ISA_BODY "finite_body.h"
#include "isa_variants.inc"

const FiniteKernels& finite_kernels() {
  static const FiniteKernels table = KT_ISA_TABLE();
  return table;
}

bool all_finite(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "all_finite: expected a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), "all_finite: expected a contiguous tensor");
  const int64_t n = t.numel();
  if (n == 0) return true;
  const void* p = t.const_data_ptr();
  const auto& k = finite_kernels();
  switch (t.scalar_type()) {
    case at::kDouble:
      return !k.u64(static_cast<const uint64_t*>(p), n, 0x7FF0000000000000ULL);
    case at::kFloat:
      return !k.u32(static_cast<const uint32_t*>(p), n, 0x7F800000U);
    case at::kHalf:
      return !k.u16(static_cast<const uint16_t*>(p), n, 0x7C00U);
    case at::kBFloat16:
      return !k.u16(static_cast<const uint16_t*>(p), n, 0x7F80U);
    case at::kFloat8_e5m2:
      return !k.u8(static_cast<const uint8_t*>(p), n, 0x7CU);
    case at::kFloat8_e4m3fn:  // no inf; NaN is S.1111.111 only
      return !k.u8(static_cast<const uint8_t*>(p), n, 0x7FU);
    default:
      TORCH_CHECK_VALUE(false, "all_finite: expected float64, float32, float16, bfloat16, "
                        "float8_e5m2 or float8_e4m3fn, got ", t.scalar_type());
  }
  return false;  // unreachable
}

}  // namespace
}  // namespace kt_kernel

TORCH_LIBRARY_FRAGMENT(kt_kernel, m) {
  m.def("all_finite(Tensor t) -> bool", &kt_kernel::all_finite);
  m.def("all_finite_isa", []() { return std::string(kt_kernel::finite_kernels().isa); });
}
