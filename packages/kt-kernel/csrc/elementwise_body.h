// Included once per ISA by elementwise.cpp inside a `#pragma GCC target` region and a
// namespace; no includes here. Every loop is written so GCC auto-vectorises it.

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

static inline double exp_d(double x) { return __builtin_exp(x); }

template <typename F>
static inline F sigmoid_t(F g);
template <>
inline float sigmoid_t<float>(float g) { return 1.0f / (1.0f + exp_f(-g)); }
template <>
inline double sigmoid_t<double>(double g) { return 1.0 / (1.0 + exp_d(-g)); }

template <typename S, typename F>
static inline F load_t(const S* p, int64_t i) {
  if constexpr (sizeof(S) == 2) {
    return bf16_to_f(p[i]);
  } else {
    return static_cast<F>(p[i]);
  }
}

template <typename S, typename F>
static inline void store_t(S* p, int64_t i, F v) {
  if constexpr (sizeof(S) == 2) {
    p[i] = f_to_bf16(v);
  } else {
    p[i] = static_cast<S>(v);
  }
}

template <typename S, typename F>
static void silu_mul_impl(const S* gu, S* h, int64_t rows, int64_t inter) {
  for (int64_t r = 0; r < rows; ++r) {
    const S* g = gu + r * 2 * inter;
    const S* u = g + inter;
    S* out = h + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      F gv = load_t<S, F>(g, i);
      F uv = load_t<S, F>(u, i);
      store_t<S, F>(out, i, gv * sigmoid_t<F>(gv) * uv);
    }
  }
}

template <typename S, typename F>
static void silu_mul_bwd_impl(const S* gu, const S* gh, const F* w, S* dgu, S* h, F* dw,
                              int64_t rows, int64_t inter) {
  // dw needs a dot product per row; the products go to a block buffer and are summed into
  // 16 fixed lanes, which vectorises without -ffast-math and fixes the summation order.
  constexpr int64_t kBlock = 256, kLanes = 16;
  F prod[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    const S* g = gu + r * 2 * inter;
    const S* u = g + inter;
    const S* ghr = gh + r * inter;
    S* dg = dgu + r * 2 * inter;
    S* du = dg + inter;
    S* hr = h + r * inter;
    const F wr = w[r];
    F lanes[kLanes] = {};
    for (int64_t i0 = 0; i0 < inter; i0 += kBlock) {
      const int64_t n = inter - i0 < kBlock ? inter - i0 : kBlock;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) {
        const int64_t i = i0 + c;
        F gv = load_t<S, F>(g, i);
        F uv = load_t<S, F>(u, i);
        F gr = load_t<S, F>(ghr, i);
        F sg = sigmoid_t<F>(gv);
        F silu = gv * sg;
        F hv = silu * uv;
        prod[c] = gr * hv;
        F dh = wr * gr;
        store_t<S, F>(hr, i, hv);
        store_t<S, F>(du, i, dh * silu);
        store_t<S, F>(dg, i, dh * uv * sg * (F(1) + gv * (F(1) - sg)));
      }
      int64_t c = 0;
      for (; c + kLanes <= n; c += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) lanes[l] += prod[c + l];
      }
      for (; c < n; ++c) lanes[c % kLanes] += prod[c];
    }
    F acc = 0;
    for (int64_t l = 0; l < kLanes; ++l) acc += lanes[l];
    dw[r] = acc;
  }
}

template <typename S, typename F>
static void scatter_impl(const S* src, const int64_t* pos, const F* w, S* y, int64_t t0,
                         int64_t t1, int64_t k, int64_t hidden) {
  constexpr int64_t kBlock = 512;  // a stack accumulator block keeps the sum in F precision
  F acc[kBlock];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t c0 = 0; c0 < hidden; c0 += kBlock) {
      const int64_t n = hidden - c0 < kBlock ? hidden - c0 : kBlock;
      for (int64_t c = 0; c < n; ++c) acc[c] = 0;
      for (int64_t j = 0; j < k; ++j) {
        const F wj = w ? w[t * k + j] : F(1);
        const S* row = src + pos[t * k + j] * hidden + c0;
#pragma omp simd
        for (int64_t c = 0; c < n; ++c) acc[c] += wj * load_t<S, F>(row, c);
      }
      S* out = y + t * hidden + c0;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) store_t<S, F>(out, c, acc[c]);
    }
  }
}

static void silu_mul_f32(const float* a, float* b, int64_t r, int64_t i) {
  silu_mul_impl<float, float>(a, b, r, i);
}
static void silu_mul_f64(const double* a, double* b, int64_t r, int64_t i) {
  silu_mul_impl<double, double>(a, b, r, i);
}
static void silu_mul_bf16(const uint16_t* a, uint16_t* b, int64_t r, int64_t i) {
  silu_mul_impl<uint16_t, float>(a, b, r, i);
}
static void silu_mul_bwd_f32(const float* gu, const float* gh, const float* w, float* dgu,
                             float* h, float* dw, int64_t r, int64_t i) {
  silu_mul_bwd_impl<float, float>(gu, gh, w, dgu, h, dw, r, i);
}
static void silu_mul_bwd_f64(const double* gu, const double* gh, const double* w, double* dgu,
                             double* h, double* dw, int64_t r, int64_t i) {
  silu_mul_bwd_impl<double, double>(gu, gh, w, dgu, h, dw, r, i);
}
static void silu_mul_bwd_bf16(const uint16_t* gu, const uint16_t* gh, const float* w,
                              uint16_t* dgu, uint16_t* h, float* dw, int64_t r, int64_t i) {
  silu_mul_bwd_impl<uint16_t, float>(gu, gh, w, dgu, h, dw, r, i);
}
static void scatter_f32(const float* s, const int64_t* p, const float* w, float* y, int64_t t0,
                        int64_t t1, int64_t k, int64_t h) {
  scatter_impl<float, float>(s, p, w, y, t0, t1, k, h);
}
static void scatter_f64(const double* s, const int64_t* p, const double* w, double* y,
                        int64_t t0, int64_t t1, int64_t k, int64_t h) {
  scatter_impl<double, double>(s, p, w, y, t0, t1, k, h);
}
static void scatter_bf16(const uint16_t* s, const int64_t* p, const float* w, uint16_t* y,
                         int64_t t0, int64_t t1, int64_t k, int64_t h) {
  scatter_impl<uint16_t, float>(s, p, w, y, t0, t1, k, h);
}

static Kernels make_table(const char* isa) {
  return Kernels{silu_mul_f32,     silu_mul_f64,     silu_mul_bf16, silu_mul_bwd_f32,
                 silu_mul_bwd_f64, silu_mul_bwd_bf16, scatter_f32,   scatter_f64,
                 scatter_bf16,     isa};
}
