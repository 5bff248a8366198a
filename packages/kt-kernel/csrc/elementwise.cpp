// The elementwise loops (activations and their gradients), one copy per ISA (isa_variants.inc);
// kernels() picks one from CPUID at first use.
#include "elementwise.h"
#include "formats.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace kt_kernel {

#define KT_ISA_BODY "elementwise_body.h"
#include "isa_variants.inc"

const Kernels& kernels() {
  static const Kernels table = KT_ISA_TABLE();
  return table;
}

}  // namespace kt_kernel
