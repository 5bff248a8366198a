// Included once per ISA by logit_rows.cpp inside a `#pragma GCC target` region and a namespace;
// no includes here. Three passes per row (max, sum of exp, gradient); a 32000-wide bf16 row is
// 64 KB and stays in L2 between them, so memory sees one read of the row and one write of its
// gradient. With a gradient, the sum pass keeps exp(x - max) in an fp32 scratch row (also in
// L2) so the gradient pass only scales it: one exp per element, not two. `omp simd`
// reductions let GCC reassociate the max and the sum (no -ffast-math).

#include "scalar_math.h"

// Rows [r0, r1) of x [n, V]: lse, the logit at the label (0 when ignored) and, when g is not
// null, g = softmax - onehot (all zeros on an ignored row), using ex [V] as scratch. Labels
// were range-checked already.
template <typename S>
static void rows(const S* x, const int64_t* labels, int64_t r0, int64_t r1, int64_t V,
                 int64_t ignore_index, float* lse, float* target, S* g, float* ex) {
  // The sum runs in fp32 lanes per block and folds into a double: 32000 terms in one fp32
  // lane set would lose about 1e-5 relative to the float64 oracle.
  constexpr int64_t kBlock = 2048;
  for (int64_t r = r0; r < r1; ++r) {
    const S* row = x + r * V;
    float mx = -__builtin_inff();
#pragma omp simd reduction(max : mx)
    for (int64_t c = 0; c < V; ++c) {
      const float v = load_t<S>(row, c);
      mx = v > mx ? v : mx;
    }
    double total = 0.0;
    // An all -inf row or a +inf logit: exp(x - mx) would be NaN; torch's logsumexp gives mx.
    const bool inf_max = mx == __builtin_inff() || mx == -__builtin_inff();
    if (!inf_max) {
      for (int64_t b = 0; b < V; b += kBlock) {
        const int64_t e = b + kBlock < V ? b + kBlock : V;
        float sum = 0.0f;
        if (g == nullptr) {
#pragma omp simd reduction(+ : sum)
          for (int64_t c = b; c < e; ++c) sum += exp_f(load_t<S>(row, c) - mx);
        } else {
#pragma omp simd reduction(+ : sum)
          for (int64_t c = b; c < e; ++c) {
            const float v = exp_f(load_t<S>(row, c) - mx);
            ex[c] = v;
            sum += v;
          }
        }
        total += sum;
      }
    }
    const float l = inf_max ? mx : mx + static_cast<float>(__builtin_log(total));
    lse[r] = l;
    const int64_t y = labels[r];
    const bool ignored = y == ignore_index;
    target[r] = ignored ? 0.0f : load_t<S>(row, y);
    if (g == nullptr) continue;
    S* out = g + r * V;
    if (ignored) {
#pragma omp simd
      for (int64_t c = 0; c < V; ++c) out[c] = to_storage<S>(0.0f);
      continue;
    }
    if (inf_max) {  // no finite softmax: exp(x - lse) gives what torch's chain gives (NaN, 0)
#pragma omp simd
      for (int64_t c = 0; c < V; ++c) ex[c] = exp_f(load_t<S>(row, c) - l);
      total = 1.0;
    }
    const float inv = static_cast<float>(1.0 / total);
#pragma omp simd
    for (int64_t c = 0; c < V; ++c) out[c] = to_storage<S>(ex[c] * inv);
    // The one-hot term is subtracted in fp32 before rounding, as softmax - onehot would be.
    out[y] = to_storage<S>(ex[y] * inv - 1.0f);
  }
}

static void rows_bf16(const uint16_t* x, const int64_t* labels, int64_t r0, int64_t r1, int64_t V,
                      int64_t ignore_index, float* lse, float* target, uint16_t* g, float* ex) {
  rows<uint16_t>(x, labels, r0, r1, V, ignore_index, lse, target, g, ex);
}

static void rows_f32(const float* x, const int64_t* labels, int64_t r0, int64_t r1, int64_t V,
                     int64_t ignore_index, float* lse, float* target, float* g, float* ex) {
  rows<float>(x, labels, r0, r1, V, ignore_index, lse, target, g, ex);
}

static LogitRowsKernels make_table(const char* isa) {
  return LogitRowsKernels{rows_bf16, rows_f32, isa};
}
