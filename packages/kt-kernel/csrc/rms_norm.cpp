// kt_kernel::rms_norm_forward / rms_norm_backward: a decoder's RMSNorm in one fused pass per
// row and direction. transformers' RMSNorm modules upcast to fp32 and run pow, mean, rsqrt,
// two muls and two casts as separate ops; their autograd chain saves several fp32 copies of
// the row and walks them again in backward (about 12 passes over fp32 tensors). Here the
// forward keeps only the per-row 1/rms, and each direction reads its inputs once.
//
// The three forms of the normalised row n = x * rsqrt(mean(x^2) + eps), in fp32:
//   round_first:  y = S(S(n) * w)            Llama, Qwen, DeepSeek-V3, GLM, Mixtral ...
//   otherwise:    y = S(n * (w + offset))    GPT-OSS, Gemma-4 (offset 0); Qwen3-Next/3.5 (1)
//   no weight:    y = S(n)
// S is the tensor's storage type (bf16 rounds; fp32 does not). Compiled per ISA like
// logit_rows.cpp.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "formats.h"

namespace kt_kernel {
namespace {

struct RmsNormKernels {
  void (*fwd_bf16)(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float, float,
                   bool, uint16_t*, float*);
  void (*fwd_f32)(const float*, const float*, int64_t, int64_t, int64_t, float, float, bool,
                  float*, float*);
  void (*bwd_bf16)(const uint16_t*, const uint16_t*, const uint16_t*, const float*, int64_t,
                   int64_t, int64_t, float, bool, uint16_t*);
  void (*bwd_f32)(const float*, const float*, const float*, const float*, int64_t, int64_t,
                  int64_t, float, bool, float*);
  const char* isa;
};

#define KT_ISA_BODY "rms_norm_body.h"
#include "isa_variants.inc"

const RmsNormKernels& rms_norm_kernels() {
  static const RmsNormKernels table = KT_ISA_TABLE();
  return table;
}

void check_rows(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.is_contiguous(), op, ": ", name,
                    " must be a contiguous [rows, H] tensor, got ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, op, ": ",
                    name, " must be bfloat16 or float32, got ", t.scalar_type());
}

const void* weight_ptr(const char* op, const at::Tensor& x,
                       const std::optional<at::Tensor>& weight) {
  if (!weight.has_value()) return nullptr;
  TORCH_CHECK_VALUE(weight->device().is_cpu() && weight->is_contiguous() && weight->dim() == 1 &&
                        weight->size(0) == x.size(1) && weight->scalar_type() == x.scalar_type(),
                    op, ": weight must be a contiguous CPU ", x.scalar_type(), " tensor of [",
                    x.size(1), "], got ", weight->scalar_type(), " ", weight->sizes());
  return weight->const_data_ptr();
}

// Rows per parallel task: about 16K elements, so short rows (per-head q/k norms) batch up.
int64_t grain(int64_t H) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)); }

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x,
                                                    const std::optional<at::Tensor>& weight,
                                                    double eps, double offset, bool round_first) {
  check_rows("rms_norm_forward", "x", x);
  const void* wp = weight_ptr("rms_norm_forward", x, weight);
  const int64_t n = x.size(0), H = x.size(1);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({n}, x.options().dtype(at::kFloat));
  if (n == 0 || H == 0) return {y, rstd};
  const auto& k = rms_norm_kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float e = static_cast<float>(eps), off = static_cast<float>(offset);
  float* rp = rstd.data_ptr<float>();
  at::parallel_for(0, n, grain(H), [&](int64_t r0, int64_t r1) {
    if (bf16) {
      k.fwd_bf16(static_cast<const uint16_t*>(x.const_data_ptr()),
                 static_cast<const uint16_t*>(wp), r0, r1, H, e, off, round_first,
                 static_cast<uint16_t*>(y.data_ptr()), rp);
    } else {
      k.fwd_f32(x.const_data_ptr<float>(), static_cast<const float*>(wp), r0, r1, H, e, off,
                round_first, y.data_ptr<float>(), rp);
    }
  });
  return {y, rstd};
}

at::Tensor rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                             const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
                             double offset, bool round_first) {
  check_rows("rms_norm_backward", "x", x);
  check_rows("rms_norm_backward", "dy", dy);
  TORCH_CHECK_VALUE(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
                    "rms_norm_backward: dy must match x (", x.scalar_type(), " ", x.sizes(),
                    "), got ", dy.scalar_type(), " ", dy.sizes());
  TORCH_CHECK_VALUE(rstd.device().is_cpu() && rstd.is_contiguous() &&
                        rstd.scalar_type() == at::kFloat && rstd.dim() == 1 &&
                        rstd.size(0) == x.size(0),
                    "rms_norm_backward: rstd must be a contiguous float32 [", x.size(0),
                    "] tensor, got ", rstd.scalar_type(), " ", rstd.sizes());
  const void* wp = weight_ptr("rms_norm_backward", x, weight);
  const int64_t n = x.size(0), H = x.size(1);
  at::Tensor dx = at::empty_like(x);
  if (n == 0 || H == 0) return dx;
  const auto& k = rms_norm_kernels();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float off = static_cast<float>(offset);
  const float* rp = rstd.const_data_ptr<float>();
  at::parallel_for(0, n, grain(H), [&](int64_t r0, int64_t r1) {
    if (bf16) {
      k.bwd_bf16(static_cast<const uint16_t*>(dy.const_data_ptr()),
                 static_cast<const uint16_t*>(x.const_data_ptr()),
                 static_cast<const uint16_t*>(wp), rp, r0, r1, H, off, round_first,
                 static_cast<uint16_t*>(dx.data_ptr()));
    } else {
      k.bwd_f32(dy.const_data_ptr<float>(), x.const_data_ptr<float>(),
                static_cast<const float*>(wp), rp, r0, r1, H, off, round_first,
                dx.data_ptr<float>());
    }
  });
  return dx;
}

}  // namespace
}  // namespace kt_kernel

TORCH_LIBRARY_FRAGMENT(kt_kernel, m) {
  m.def(
      "rms_norm_forward(Tensor x, Tensor? weight, float eps, float offset, bool round_first) "
      "-> (Tensor, Tensor)",
      &kt_kernel::rms_norm_forward);
  m.def(
      "rms_norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float offset, "
      "bool round_first) -> Tensor",
      &kt_kernel::rms_norm_backward);
  m.def("rms_norm_isa", []() { return std::string(kt_kernel::rms_norm_kernels().isa); });
}
