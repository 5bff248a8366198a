// The test-facing entries over one format's native routines: its tile loader
// (dequantize_tile) and the two products of one expert's projection as the op computes them
// (project: the small-row routine up to gemv_rows() rows, tile + GEMM above).
#include <ATen/ATen.h>
#include <torch/extension.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

#include "formats.h"
#include "moe_common.h"

namespace kt_kernel {

// W_e[row0 : row0 + rows, col0 : col0 + cols] of every expert through the format's tile loader
// (or a copy for dense): for tests of each loader against its Python `dequantize`.
at::Tensor dequantize_tile(const std::string& format, const std::vector<at::Tensor>& parts,
                           int64_t n, int64_t k, int64_t row0, int64_t col0, int64_t rows,
                           int64_t cols, at::ScalarType dtype) {
  const formats::Format& f = formats::find_format(format);
  TORCH_CHECK_VALUE(!parts.empty() && parts[0].defined() && parts[0].dim() >= 1,
                    "parts must be the format's tensors");
  TORCH_CHECK_VALUE(n >= 0 && k >= 0, "n and k must be >= 0, got ", n, " and ", k);
  const int64_t e_count = parts[0].size(0);
  f.check(parts, e_count, n, k, "parts");
  // Never `row0 + rows <= n`: it wraps for row0 near INT64_MAX and passes.
  TORCH_CHECK_VALUE(rows > 0 && cols > 0 && formats::range_within(row0, rows, n) &&
                        formats::range_within(col0, cols, k),
                    "tile of ", rows, " rows from row ", row0, " and ", cols,
                    " columns from column ", col0, " out of range of [", n, ", ", k, "]");
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kBFloat16 ||
                       (f.load == nullptr && dtype == at::kDouble),
                   "dtype must be float32 or bfloat16, got ", dtype);
  if (f.load == nullptr) {
    return parts[0].narrow(1, row0, rows).narrow(2, col0, cols).to(dtype).contiguous();
  }
  at::Tensor out = at::empty({e_count, rows, cols}, at::TensorOptions().dtype(dtype));
  const common::Projection p{&f, parts, e_count, n, k};
  for (int64_t e = 0; e < e_count; ++e) {
    char* dst = static_cast<char*>(out.data_ptr()) + e * rows * cols * out.element_size();
    f.load(p.view(e), row0, col0, rows, cols, dtype, dst, cols);
  }
  return out;
}

// in [m, K] @ W_e^T -> [m, N] (nn false) or in [m, N] @ W_e -> [m, K] (nn true) for expert
// `expert` of a projection W [E, N, K] in `format`, exactly as the op computes a task's product.
at::Tensor project(const std::string& format, const std::vector<at::Tensor>& parts, int64_t n,
                   int64_t k, int64_t expert, const at::Tensor& in, bool nn) {
  const formats::Format& f = formats::find_format(format);
  TORCH_CHECK_VALUE(!parts.empty() && parts[0].defined() && parts[0].dim() >= 1,
                    "parts must be the format's tensors");
  TORCH_CHECK_VALUE(n >= 0 && k >= 0, "n and k must be >= 0, got ", n, " and ", k);
  const int64_t e_count = parts[0].size(0);
  f.check(parts, e_count, n, k, "parts");
  TORCH_CHECK_INDEX(expert >= 0 && expert < e_count, "expert must lie in [0, ", e_count,
                    "), got ", expert);
  TORCH_CHECK_VALUE(in.defined() && in.dim() == 2 && in.size(1) == (nn ? n : k),
                    "in must be a 2-D [m, ", nn ? n : k, "] tensor, got ",
                    in.defined() ? in.sizes() : at::IntArrayRef{});
  const auto dt = in.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 ||
                       (f.load == nullptr && dt == at::kDouble),
                   "in must be float32 or bfloat16, got ", dt);
  if (f.load == nullptr) {
    TORCH_CHECK_TYPE(parts[0].scalar_type() == dt, "dense weights must have in's dtype ", dt);
  }
  const at::Tensor x = in.contiguous();
  at::Tensor out = at::empty({x.size(0), nn ? k : n}, x.options());
  const common::Projection p{&f, parts, e_count, n, k};
  if (nn) {
    p.nn(out, x, expert);
  } else {
    p.nt(out, x, expert);
  }
  return out;
}

}  // namespace kt_kernel
