// Per-ISA copies of the elementwise loops. The extension is built without -march=native so
// the wheel runs on any x86-64; each copy below is compiled for its ISA by a target pragma
// and kernels() picks one from CPUID at first use.
#include "elementwise.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace kt_kernel {

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,bmi2")
namespace isa_avx512 {
#include "elementwise_body.h"
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi2")
namespace isa_avx2 {
#include "elementwise_body.h"
}  // namespace isa_avx2
#pragma GCC pop_options
#endif

namespace isa_base {
#include "elementwise_body.h"
}  // namespace isa_base

static Kernels select() {
  // KT_KERNEL_ISA=avx2|scalar caps the choice (for testing the fallback paths).
  const char* cap = std::getenv("KT_KERNEL_ISA");
  const bool allow512 = !cap || std::strcmp(cap, "avx512") == 0;
  const bool allow2 = allow512 || std::strcmp(cap, "avx2") == 0;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (allow512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return isa_avx512::make_table("avx512");
  }
  if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return isa_avx2::make_table("avx2");
  }
#endif
  return isa_base::make_table("scalar");
}

const Kernels& kernels() {
  static const Kernels table = select();
  return table;
}

}  // namespace kt_kernel
