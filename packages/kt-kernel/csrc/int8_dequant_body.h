// The INT8 tile loops (format_int8.cpp), included once per ISA inside a `#pragma GCC target`
// region and a namespace that first defines the vector layer `V`:
//   V::F (a vector of V::L fp32), V::load_q(p) (V::L int8 at p, widened to fp32), V::mul,
//   V::set1, V::store_f32(dst, v) and, where the bf16 loop is instantiated, V::store_bf16(dst,
//   v) (round to nearest even). No includes here.
//
// out[r * ldo + c] = q[r * ldq + c] * scale[r] for r < rows, c < cols. The product is formed in
// fp32 and rounded once (to nearest even for bf16), exactly as the Python reference does, so
// every ISA gives bitwise the same tile; the columns past the last full vector take the same
// product in scalar code.

// W is V (a template parameter so that V::store_bf16 is looked up only where Bf16 needs it).
template <bool Bf16, typename W = V>
static void dequant(const int8_t* q, int64_t ldq, const float* scale, int64_t rows,
                    int64_t cols, void* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const typename W::F s = W::set1(scale[r]);
    const int8_t* src = q + r * ldq;
    int64_t c = 0;
    if constexpr (Bf16) {
      uint16_t* dst = static_cast<uint16_t*>(out) + r * ldo;
      for (; c + W::L <= cols; c += W::L) W::store_bf16(dst + c, W::mul(W::load_q(src + c), s));
      for (; c < cols; ++c) {
        dst[c] = c10::BFloat16(static_cast<float>(src[c]) * scale[r]).x;
      }
    } else {
      float* dst = static_cast<float*>(out) + r * ldo;
      for (; c + W::L <= cols; c += W::L) W::store_f32(dst + c, W::mul(W::load_q(src + c), s));
      for (; c < cols; ++c) dst[c] = static_cast<float>(src[c]) * scale[r];
    }
  }
}
