// Included once per ISA by rms_norm.cpp inside a `#pragma GCC target` region and a namespace;
// no includes here. Per row: one pass for the sum of squares and one that writes the output
// (backward: one for <dn, x> and one for dx); a row is at most a few KB and stays in L1
// between its passes, so memory sees each input read once and each output written once.
// `omp simd` lets GCC reassociate the sums (no -ffast-math).

#include "scalar_math.h"

// The value a float takes when stored in S and read back: bf16 rounding, or none.
template <typename S>
static inline float round_s(float v) {
  if constexpr (sizeof(S) == 2) {
    return bf16_to_f(f_to_bf16(v));
  } else {
    return v;
  }
}

// The scale that multiplies the normalised row, per element: none, w (after rounding the
// normalised value to S when round_first) or w + offset in fp32. See rms_norm.cpp.
template <typename S>
static void fwd(const S* x, const S* w, int64_t r0, int64_t r1, int64_t H, float eps,
                float offset, bool round_first, S* y, float* rstd) {
  for (int64_t r = r0; r < r1; ++r) {
    const S* xr = x + r * H;
    S* yr = y + r * H;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < H; ++j) {
      const float v = load_t<S>(xr, j);
      ss += v * v;
    }
    const float rs = 1.0f / __builtin_sqrtf(ss / static_cast<float>(H) + eps);
    rstd[r] = rs;
    if (w == nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) yr[j] = to_storage<S>(load_t<S>(xr, j) * rs);
    } else if (round_first) {
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) {
        yr[j] = to_storage<S>(round_s<S>(load_t<S>(xr, j) * rs) * load_t<S>(w, j));
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) {
        yr[j] = to_storage<S>(load_t<S>(xr, j) * rs * (load_t<S>(w, j) + offset));
      }
    }
  }
}

// dn = dL/d(normalised row) as autograd's chain forms it. Form 0: no weight; 1 (round_first):
// the product dy * w rounded to S (its MulBackward runs in S); 2: dy * (w + offset) in fp32.
template <typename S, int Form>
static inline float dn_at(const S* dyr, const S* w, int64_t j, float offset) {
  if constexpr (Form == 0) {
    return load_t<S>(dyr, j);
  } else if constexpr (Form == 1) {
    return round_s<S>(load_t<S>(dyr, j) * load_t<S>(w, j));
  } else {
    return load_t<S>(dyr, j) * (load_t<S>(w, j) + offset);
  }
}

// dx = rs * dn - x * rs^3 * <dn, x> / H, from the rstd the forward kept; the form is a
// template argument so that both loops vectorise without a branch.
template <typename S, int Form>
static void bwd_form(const S* dy, const S* x, const S* w, const float* rstd, int64_t r0,
                     int64_t r1, int64_t H, float offset, S* dx) {
  for (int64_t r = r0; r < r1; ++r) {
    const S* xr = x + r * H;
    const S* dyr = dy + r * H;
    S* dxr = dx + r * H;
    const float rs = rstd[r];
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < H; ++j) dot += dn_at<S, Form>(dyr, w, j, offset) * load_t<S>(xr, j);
    const float k = rs * rs * rs * dot / static_cast<float>(H);
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      dxr[j] = to_storage<S>(rs * dn_at<S, Form>(dyr, w, j, offset) - load_t<S>(xr, j) * k);
    }
  }
}

template <typename S>
static void bwd(const S* dy, const S* x, const S* w, const float* rstd, int64_t r0, int64_t r1,
                int64_t H, float offset, bool round_first, S* dx) {
  if (w == nullptr) {
    bwd_form<S, 0>(dy, x, w, rstd, r0, r1, H, offset, dx);
  } else if (round_first) {
    bwd_form<S, 1>(dy, x, w, rstd, r0, r1, H, offset, dx);
  } else {
    bwd_form<S, 2>(dy, x, w, rstd, r0, r1, H, offset, dx);
  }
}

static void fwd_bf16(const uint16_t* x, const uint16_t* w, int64_t r0, int64_t r1, int64_t H,
                     float eps, float offset, bool round_first, uint16_t* y, float* rstd) {
  fwd<uint16_t>(x, w, r0, r1, H, eps, offset, round_first, y, rstd);
}
static void fwd_f32(const float* x, const float* w, int64_t r0, int64_t r1, int64_t H, float eps,
                    float offset, bool round_first, float* y, float* rstd) {
  fwd<float>(x, w, r0, r1, H, eps, offset, round_first, y, rstd);
}
static void bwd_bf16(const uint16_t* dy, const uint16_t* x, const uint16_t* w, const float* rstd,
                     int64_t r0, int64_t r1, int64_t H, float offset, bool round_first,
                     uint16_t* dx) {
  bwd<uint16_t>(dy, x, w, rstd, r0, r1, H, offset, round_first, dx);
}
static void bwd_f32(const float* dy, const float* x, const float* w, const float* rstd, int64_t r0,
                    int64_t r1, int64_t H, float offset, bool round_first, float* dx) {
  bwd<float>(dy, x, w, rstd, r0, r1, H, offset, round_first, dx);
}

static RmsNormKernels make_table(const char* isa) {
  return RmsNormKernels{fwd_bf16, fwd_f32, bwd_bf16, bwd_f32, isa};
}
