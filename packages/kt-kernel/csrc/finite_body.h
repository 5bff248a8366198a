// Included once per ISA by finite.cpp inside a `#pragma GCC target` region and a namespace;
// no includes here. Every loop is written so GCC auto-vectorises it.

// Whether any of x[0, n) has every exponent bit set (NaN or +-inf in IEEE layouts; NaN in
// E4M3FN, whose exponent mask includes the mantissa). (x & mask) <= mask for every x, so the
// maximum of the masked bits equals the mask exactly when some element is non-finite: one AND
// and one unsigned max per element, no compare or branch in the loop. Blocks of 4096 keep the
// early exit without costing the vector loop its width.
template <typename U>
static bool any_all_ones(const U* x, int64_t n, U mask) {
  constexpr int64_t kBlock = 4096;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = b + kBlock < n ? b + kBlock : n;
    U m = 0;
    for (int64_t i = b; i < e; ++i) {
      const U v = static_cast<U>(x[i] & mask);
      m = v > m ? v : m;
    }
    if (m == mask) return true;
  }
  return false;
}

static bool scan_u8(const uint8_t* x, int64_t n, uint8_t mask) { return any_all_ones(x, n, mask); }
static bool scan_u16(const uint16_t* x, int64_t n, uint16_t mask) {
  return any_all_ones(x, n, mask);
}
static bool scan_u32(const uint32_t* x, int64_t n, uint32_t mask) {
  return any_all_ones(x, n, mask);
}
static bool scan_u64(const uint64_t* x, int64_t n, uint64_t mask) {
  return any_all_ones(x, n, mask);
}

static FiniteKernels make_table(const char* isa) {
  return FiniteKernels{scan_u8, scan_u16, scan_u32, scan_u64, isa};
}
