// Per-ISA copies of the elementwise loops. The extension is built without -march=native so
// the wheel runs on any x86-64; each copy below is compiled for its ISA by a target pragma
// and kernels() picks one from CPUID at first use.
#include "elementwise.h"
#include "formats.h"

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

const Kernels& kernels() {
  static const Kernels table = KT_ISA_TABLE();
  return table;
}

}  // namespace kt_kernel
