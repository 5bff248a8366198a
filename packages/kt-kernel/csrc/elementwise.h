// Elementwise and routing loops of the MoE expert op, compiled per ISA and picked at run time.
#pragma once
#include <cstdint>

namespace kt_kernel {

// The gated expert activation h = act(g, u) applied to gu = [g | u] (each [rows, I]):
//   kSwiGLU        h = silu(g) * u
//   kClampedSwiGLU h = min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, +-limit) + 1)
//                  (GPT-OSS; transformers' GptOssExperts._apply_gate)
//   kSwiGLULimit   h = silu(min(g, limit)) * clamp(u, +-limit)   (DeepSeek-V4)
//   kGeluTanhGated h = gelu_tanh(g) * u                            (Gemma's gated GELU)
enum ActKind : int { kSwiGLU = 0, kClampedSwiGLU = 1, kSwiGLULimit = 2, kGeluTanhGated = 3 };
struct Act {
  int kind = kSwiGLU;
  double alpha = 1.0;  // clamped_swiglu only
  double limit = 0.0;  // clamped_swiglu and swiglu_limit only
};

// bf16 travels as raw uint16 bits so the loops auto-vectorise without c10 types.
struct Kernels {
  // h[r, i] = act(gu[r, i], gu[r, I + i]) for rows [0, rows); gu has row stride 2I.
  void (*act_fwd_f32)(const float*, float*, int64_t rows, int64_t inter, const Act&);
  void (*act_fwd_f64)(const double*, double*, int64_t rows, int64_t inter, const Act&);
  void (*act_fwd_bf16)(const uint16_t*, uint16_t*, int64_t rows, int64_t inter, const Act&);
  // Given gu [rows, 2I], gh = dL/dh before routing weights [rows, I] and w [rows]:
  // dgu = dact * w*gh, h = act(g, u), dw[r] = <gh[r], h[r]> (accumulated in float/double).
  void (*act_bwd_f32)(const float*, const float*, const float*, float*, float*, float*,
                      int64_t rows, int64_t inter, const Act&);
  void (*act_bwd_f64)(const double*, const double*, const double*, double*, double*, double*,
                      int64_t rows, int64_t inter, const Act&);
  void (*act_bwd_bf16)(const uint16_t*, const uint16_t*, const float*, uint16_t*, uint16_t*,
                       float*, int64_t rows, int64_t inter, const Act&);
  // y[t] = sum_j w[t*k + j] * src[pos[t*k + j]] for t in [t0, t1), summed in j order in
  // float/double; w == nullptr means weight 1.
  void (*scatter_f32)(const float*, const int64_t*, const float*, float*, int64_t t0,
                      int64_t t1, int64_t k, int64_t hidden);
  void (*scatter_f64)(const double*, const int64_t*, const double*, double*, int64_t t0,
                      int64_t t1, int64_t k, int64_t hidden);
  void (*scatter_bf16)(const uint16_t*, const int64_t*, const float*, uint16_t*, int64_t t0,
                       int64_t t1, int64_t k, int64_t hidden);
  const char* isa;
};

// The table for isa_level() (formats.h): AVX-512, AVX2+FMA or baseline x86-64.
const Kernels& kernels();

}  // namespace kt_kernel
