// Scalar float helpers written so GCC vectorises the loops that call them: bf16 <-> float
// conversion, element loads and stores in a tensor's storage type, and a polynomial expf.
// Included inside a per-ISA namespace by the *_body.h files (elementwise, attention rows,
// logit rows), so each ISA gets its own copy; no includes here.

static inline float bf16_to_f(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  // Round to nearest even, as c10::BFloat16 does; NaN stays a quiet NaN.
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
}

// Storage types are float, double or a 2-byte type holding raw bf16 bits; F is the compute type.
template <typename S, typename F = float>
static inline F load_t(const S* p, int64_t i) {
  if constexpr (sizeof(S) == 2) {
    return bf16_to_f(p[i]);
  } else {
    return static_cast<F>(p[i]);
  }
}

template <typename S, typename F>
static inline S to_storage(F v) {
  if constexpr (sizeof(S) == 2) {
    return f_to_bf16(static_cast<float>(v));
  } else {
    return static_cast<S>(v);
  }
}

template <typename S, typename F>
static inline void store_t(S* p, int64_t i, F v) {
  p[i] = to_storage<S>(v);
}

// Cephes-style expf: range reduction by ln2 in two parts and a degree-6 polynomial,
// about 1 ulp on the clamped range; vectorisable (no libm call).
static inline float exp_f(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float fx = x * 1.44269504088896341f;
  fx = (fx + 12582912.0f) - 12582912.0f;  // round to nearest integer
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  int32_t e = static_cast<int32_t>(fx) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, 4);
  return y * scale;
}
