// kt_kernel::logit_rows: per row of LM-head logits, the fp32 log-sum-exp, the logit at the
// label and the cross-entropy gradient softmax - onehot, in one fused pass per row. The torch
// chain it replaces in moe-experts' chunked losses (bf16 -> fp32 copy, logsumexp, sub, exp,
// scatter_add, cast back) streams a [chunk, V] fp32 tensor through memory about six times;
// here each logits row is read from memory once and its gradient written once. Compiled per
// ISA like finite.cpp.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "formats.h"

namespace kt_kernel {
namespace {

struct LogitRowsKernels {
  void (*bf16)(const uint16_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*, float*,
               uint16_t*, float*);
  void (*f32)(const float*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*, float*,
              float*, float*);
  const char* isa;
};

#define KT_ISA_BODY "logit_rows_body.h"
#include "isa_variants.inc"

const LogitRowsKernels& logit_rows_kernels() {
  static const LogitRowsKernels table = KT_ISA_TABLE();
  return table;
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> logit_rows(
    const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index, bool want_grad,
    const std::optional<at::Tensor>& out) {
  TORCH_CHECK_VALUE(logits.device().is_cpu() && labels.device().is_cpu(),
                    "logit_rows: expected CPU tensors, got logits on ", logits.device(),
                    " and labels on ", labels.device());
  TORCH_CHECK_VALUE(logits.dim() == 2, "logit_rows: logits must be [n, V], got ",
                    logits.sizes());
  TORCH_CHECK_VALUE(logits.is_contiguous(), "logit_rows: logits must be contiguous");
  TORCH_CHECK_VALUE(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
                    "logit_rows: logits must be bfloat16 or float32, got ", logits.scalar_type());
  TORCH_CHECK_VALUE(labels.scalar_type() == at::kLong, "logit_rows: labels must be int64, got ",
                    labels.scalar_type());
  const int64_t n = logits.size(0);
  const int64_t V = logits.size(1);
  TORCH_CHECK_VALUE(labels.dim() == 1 && labels.size(0) == n, "logit_rows: labels must be [n] = [",
                    n, "], got ", labels.sizes());
  TORCH_CHECK_VALUE(V >= 1, "logit_rows: logits must have at least one column, got V = 0");
  const at::Tensor y = labels.contiguous();
  const int64_t* yp = y.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(yp[i] == ignore_index || (yp[i] >= 0 && yp[i] < V), "logit_rows: labels[",
                      i, "] = ", yp[i], " is outside [0, ", V, ") and is not ignore_index (",
                      ignore_index, ")");
  }
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({n}, f32);
  at::Tensor target = at::empty({n}, f32);
  std::optional<at::Tensor> grad;
  if (want_grad && out.has_value()) {
    // A caller's buffer reused chunk after chunk: a fresh [n, V] tensor costs page faults and
    // the kernel's zeroing on every call (glibc maps allocations this large anew each time),
    // which took longer than the op's own passes.
    TORCH_CHECK_VALUE(out->device().is_cpu() && out->is_contiguous() &&
                          out->scalar_type() == logits.scalar_type() && out->sizes() == logits.sizes(),
                      "logit_rows: out must be a contiguous CPU ", logits.scalar_type(), " tensor of ",
                      logits.sizes(), ", got ", out->scalar_type(), " ", out->sizes());
    grad = *out;
  } else if (want_grad) {
    grad = at::empty({n, V}, logits.options());
  }
  if (n == 0) return {lse, target, grad};
  const auto& k = logit_rows_kernels();
  float* lp = lse.data_ptr<float>();
  float* tp = target.data_ptr<float>();
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const void* xp = logits.const_data_ptr();
  void* gp = want_grad ? grad->data_ptr() : nullptr;
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    // One fp32 row of exp(x - max) per thread's range, reused row after row (stays in L2).
    std::vector<float> scratch(want_grad ? V : 0);
    float* ex = scratch.data();
    if (bf16) {
      k.bf16(static_cast<const uint16_t*>(xp), yp, r0, r1, V, ignore_index, lp, tp,
             static_cast<uint16_t*>(gp), ex);
    } else {
      k.f32(static_cast<const float*>(xp), yp, r0, r1, V, ignore_index, lp, tp,
            static_cast<float*>(gp), ex);
    }
  });
  return {lse, target, grad};
}

}  // namespace
}  // namespace kt_kernel

TORCH_LIBRARY_FRAGMENT(kt_kernel, m) {
  m.def(
      "logit_rows(Tensor logits, Tensor labels, int ignore_index, bool want_grad, "
      "Tensor(a!)? out=None) -> (Tensor, Tensor, Tensor?)",
      &kt_kernel::logit_rows);
  m.def("logit_rows_isa", []() { return std::string(kt_kernel::logit_rows_kernels().isa); });
}
