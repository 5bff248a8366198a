// Included once per ISA by elementwise.cpp inside a `#pragma GCC target` region and a
// namespace; no includes here. Every loop is written so GCC auto-vectorises it.

#include "scalar_math.h"

static inline double exp_d(double x) { return __builtin_exp(x); }

template <typename F>
static inline F sigmoid_t(F g);
template <>
inline float sigmoid_t<float>(float g) { return 1.0f / (1.0f + exp_f(-g)); }
template <>
inline double sigmoid_t<double>(double g) { return 1.0 / (1.0 + exp_d(-g)); }

// Tanh through exp (vectorisable): 1 - 2 / (exp(2y) + 1); saturates cleanly at +-1.
template <typename F>
static inline F tanh_t(F y) {
  if constexpr (sizeof(F) == 4) {
    return 1.0f - 2.0f / (exp_f(2.0f * y) + 1.0f);
  } else {
    return 1.0 - 2.0 / (exp_d(2.0 * y) + 1.0);
  }
}

// The gated activations h = act(g, u) (see elementwise.h, ActKind) and their exact derivatives.
// Clamps follow torch.clamp: the gradient passes where the input lies inside the closed range.
template <int K, typename F>
static inline F act_fwd_one(F g, F u, F alpha, F limit) {
  if constexpr (K == 0) {  // swiglu
    return g * sigmoid_t<F>(g) * u;
  } else if constexpr (K == 1) {  // clamped_swiglu (GPT-OSS)
    const F gc = g > limit ? limit : g;
    const F uc = u > limit ? limit : (u < -limit ? -limit : u);
    return gc * sigmoid_t<F>(alpha * gc) * (uc + F(1));
  } else if constexpr (K == 2) {  // swiglu_limit (DeepSeek-V4)
    const F gc = g > limit ? limit : g;
    const F uc = u > limit ? limit : (u < -limit ? -limit : u);
    return gc * sigmoid_t<F>(gc) * uc;
  } else {  // gelu_tanh_gated
    const F y = F(0.7978845608028654) * (g + F(0.044715) * g * g * g);
    return F(0.5) * g * (F(1) + tanh_t<F>(y)) * u;
  }
}

// h = act(g, u); dg = dh * dact/dg; du = dh * dact/du.
template <int K, typename F>
static inline void act_bwd_one(F g, F u, F dh, F alpha, F limit, F& h, F& dg, F& du) {
  if constexpr (K == 0) {
    const F sg = sigmoid_t<F>(g);
    const F silu = g * sg;
    h = silu * u;
    du = dh * silu;
    dg = dh * u * sg * (F(1) + g * (F(1) - sg));
  } else if constexpr (K == 1) {
    const F gc = g > limit ? limit : g;
    const F uc = u > limit ? limit : (u < -limit ? -limit : u);
    const F s = sigmoid_t<F>(alpha * gc);
    const F glu = gc * s;
    h = glu * (uc + F(1));
    du = (u >= -limit && u <= limit) ? dh * glu : F(0);
    dg = g <= limit ? dh * (uc + F(1)) * s * (F(1) + alpha * gc * (F(1) - s)) : F(0);
  } else if constexpr (K == 2) {
    const F gc = g > limit ? limit : g;
    const F uc = u > limit ? limit : (u < -limit ? -limit : u);
    const F s = sigmoid_t<F>(gc);
    const F silu = gc * s;
    h = silu * uc;
    du = (u >= -limit && u <= limit) ? dh * silu : F(0);
    dg = g <= limit ? dh * uc * s * (F(1) + gc * (F(1) - s)) : F(0);
  } else {
    const F c = F(0.7978845608028654), a = F(0.044715);
    const F g2 = g * g;
    const F t = tanh_t<F>(c * (g + a * g2 * g));
    const F gelu = F(0.5) * g * (F(1) + t);
    h = gelu * u;
    du = dh * gelu;
    dg = dh * u * (F(0.5) * (F(1) + t) + F(0.5) * g * (F(1) - t * t) * c * (F(1) + F(3) * a * g2));
  }
}

template <int K, typename S, typename F>
static void act_fwd_impl(const S* gu, S* h, int64_t rows, int64_t inter, F alpha, F limit) {
  for (int64_t r = 0; r < rows; ++r) {
    const S* g = gu + r * 2 * inter;
    const S* u = g + inter;
    S* out = h + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      F gv = load_t<S, F>(g, i);
      F uv = load_t<S, F>(u, i);
      store_t<S, F>(out, i, act_fwd_one<K, F>(gv, uv, alpha, limit));
    }
  }
}

template <int K, typename S, typename F>
static void act_bwd_impl(const S* gu, const S* gh, const F* w, S* dgu, S* h, F* dw,
                         int64_t rows, int64_t inter, F alpha, F limit) {
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
        F hv, dgv, duv;
        act_bwd_one<K, F>(gv, uv, wr * gr, alpha, limit, hv, dgv, duv);
        prod[c] = gr * hv;
        store_t<S, F>(hr, i, hv);
        store_t<S, F>(du, i, duv);
        store_t<S, F>(dg, i, dgv);
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

// Runtime activation kind -> compile-time instantiation (the switch sits outside the loops).
#define KT_ACT_DISPATCH(kind, CALL)   \
  switch (kind) {                     \
    case 0: { constexpr int K = 0; CALL; break; } \
    case 1: { constexpr int K = 1; CALL; break; } \
    case 2: { constexpr int K = 2; CALL; break; } \
    default: { constexpr int K = 3; CALL; break; } \
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

static void act_fwd_f32(const float* a, float* b, int64_t r, int64_t i, const Act& act) {
  KT_ACT_DISPATCH(act.kind, (act_fwd_impl<K, float, float>(a, b, r, i, act.alpha, act.limit)))
}
static void act_fwd_f64(const double* a, double* b, int64_t r, int64_t i, const Act& act) {
  KT_ACT_DISPATCH(act.kind, (act_fwd_impl<K, double, double>(a, b, r, i, act.alpha, act.limit)))
}
static void act_fwd_bf16(const uint16_t* a, uint16_t* b, int64_t r, int64_t i, const Act& act) {
  KT_ACT_DISPATCH(act.kind, (act_fwd_impl<K, uint16_t, float>(a, b, r, i, act.alpha, act.limit)))
}
static void act_bwd_f32(const float* gu, const float* gh, const float* w, float* dgu, float* h,
                        float* dw, int64_t r, int64_t i, const Act& act) {
  KT_ACT_DISPATCH(act.kind, (act_bwd_impl<K, float, float>(gu, gh, w, dgu, h, dw, r, i,
                                                           act.alpha, act.limit)))
}
static void act_bwd_f64(const double* gu, const double* gh, const double* w, double* dgu,
                        double* h, double* dw, int64_t r, int64_t i, const Act& act) {
  KT_ACT_DISPATCH(act.kind, (act_bwd_impl<K, double, double>(gu, gh, w, dgu, h, dw, r, i,
                                                             act.alpha, act.limit)))
}
static void act_bwd_bf16(const uint16_t* gu, const uint16_t* gh, const float* w, uint16_t* dgu,
                         uint16_t* h, float* dw, int64_t r, int64_t i, const Act& act) {
  KT_ACT_DISPATCH(act.kind, (act_bwd_impl<K, uint16_t, float>(gu, gh, w, dgu, h, dw, r, i,
                                                              act.alpha, act.limit)))
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
  return Kernels{act_fwd_f32, act_fwd_f64, act_fwd_bf16, act_bwd_f32, act_bwd_f64,
                 act_bwd_bf16, scatter_f32, scatter_f64, scatter_bf16, isa};
}
