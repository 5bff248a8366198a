// Included once per ISA by attention_simd.cpp inside a `#pragma GCC target` region and a
// namespace; no includes here. The row passes of attention.h (RowFns), fused so each block of
// scores is read once while it is in cache. `omp simd` reductions let GCC reassociate the
// max and the sum (the build has no -ffast-math).

#include "scalar_math.h"

template <typename S>
static void fwd_row(const float* s, int64_t nv, int64_t n_pad, float scale, float* m, float* l,
                    S* p, float* o, int64_t d) {
  float mx = -__builtin_inff();
#pragma omp simd reduction(max : mx)
  for (int64_t c = 0; c < nv; ++c) {
    const float x = s[c] * scale;
    mx = x > mx ? x : mx;
  }
  const float m_old = *m;
  const float m_new = mx > m_old ? mx : m_old;
  // m_old is -inf only before the first block, whose key 0 every query sees.
  const float alpha = m_old == -__builtin_inff() ? 0.0f : exp_f(m_old - m_new);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < nv; ++c) {
    const float e = exp_f(s[c] * scale - m_new);
    sum += e;
    p[c] = to_storage<S>(e);
  }
  for (int64_t c = nv; c < n_pad; ++c) p[c] = to_storage<S>(0.0f);
  if (alpha != 1.0f) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) o[j] *= alpha;
  }
  *l = *l * alpha + sum;
  *m = m_new;
}

template <typename S>
static void bwd_row(const float* s, const float* dp, int64_t nv, int64_t n, int64_t n_pad,
                    float scale, float lse, float delta, S* p_pair, S* ds_row, S* ds_pair) {
#pragma omp simd
  for (int64_t c = 0; c < nv; ++c) {
    const float p = exp_f(s[c] * scale - lse);
    const float ds = scale * p * (dp[c] - delta);
    p_pair[2 * c] = to_storage<S>(p);
    const S dsv = to_storage<S>(ds);
    ds_row[c] = dsv;
    ds_pair[2 * c] = dsv;
  }
  for (int64_t c = nv; c < n; ++c) {
    p_pair[2 * c] = to_storage<S>(0.0f);
    ds_pair[2 * c] = to_storage<S>(0.0f);
  }
  for (int64_t c = nv; c < n_pad; ++c) ds_row[c] = to_storage<S>(0.0f);
}

// Portable GEMM over the pair-packed layout (attention.h): the fp32 path everywhere, and the
// bf16 path on CPUs without AVX512_BF16.
template <typename S>
static void gemm_loops(int64_t M, int64_t N, int64_t K, const S* A, int64_t lda, const S* B,
                       int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  const int64_t k2 = (K + 1) / 2;
  for (int64_t i = 0; i < M; ++i) {
    float* c = C + i * ldc;
    if (!accumulate) {
      for (int64_t j = 0; j < N; ++j) c[j] = 0.0f;
    }
    const S* a = A + i * lda;
    for (int64_t kp = 0; kp < k2; ++kp) {
      float a0, a1;
      const S* b = B + 2 * kp * ldb;
      if constexpr (sizeof(S) == 2) {
        a0 = bf16_to_f(a[2 * kp]);
        a1 = bf16_to_f(a[2 * kp + 1]);
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) {
          c[j] += a0 * bf16_to_f(b[2 * j]) + a1 * bf16_to_f(b[2 * j + 1]);
        }
      } else {
        a0 = a[2 * kp];
        a1 = a[2 * kp + 1];
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) c[j] += a0 * b[2 * j] + a1 * b[2 * j + 1];
      }
    }
  }
}
