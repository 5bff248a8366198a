// Causal flash-style attention with grouped KV heads (GQA) on the CPU, registered as
// torch.ops.kt_kernel.attention_forward / attention_backward.
//
// Layout of the work: the G = Hq / Hkv query heads that share a KV head are stacked into one
// block of M = G x rows query rows, so every block of K and V is read once for all of them.
// Per block of keys the scores S = Q K^T land in a cache-resident fp32 block; the softmax,
// the causal mask and (backward) dS = P (dP - rowdot(dO, O)) run over it in fused row passes
// (attention_rows_body.h) before the next GEMM reads it. Blocks wholly above the diagonal are
// never visited. The forward keeps the per-row log-sum-exp; the backward recomputes P from it.
// dK and dV are accumulated transposed ([D, T], so their GEMMs read the pair-packed P and dS
// rows directly) in one fp32 buffer per (batch, KV head, chunk of query blocks): chunks run in
// parallel without races and are summed at the end.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention.h"
#include "moe_common.h"

namespace kt_kernel {
namespace attention {
namespace {

// Query rows of all G heads per block, and keys per block. A backward block holds S, dP (fp32,
// M x keys), P and dS (bf16, twice) and Q, dO (both layouts): about 1 MB at 256 x 128 x D=128,
// the L2 of one core.
constexpr int64_t kRowsPerBlock = 256;
constexpr int64_t kKeysFwd = 256;
constexpr int64_t kKeysBwd = 128;

template <typename S>
inline float load_f(S x) {
  if constexpr (sizeof(S) == 2) {
    return static_cast<float>(c10::BFloat16(x, c10::BFloat16::from_bits()));
  } else {
    return x;
  }
}

template <typename S>
inline S store_f(float x) {
  if constexpr (sizeof(S) == 2) {
    return c10::BFloat16(x).x;
  } else {
    return x;
  }
}

template <typename S>
const RowFns<S>& row_fns() {
  if constexpr (sizeof(S) == 2) {
    return rows().bf16;
  } else {
    return rows().f32;
  }
}

// A [B, H, T, D] tensor whose last stride is 1.
template <typename S>
struct View4 {
  const S* p;
  int64_t s0, s1, s2;
  const S* row(int64_t b, int64_t h, int64_t t) const { return p + b * s0 + h * s1 + t * s2; }
};

template <typename S>
View4<S> view(const at::Tensor& x) {
  return {static_cast<const S*>(x.data_ptr()), x.stride(0), x.stride(1), x.stride(2)};
}

struct Dims {
  int64_t B, Hq, Hkv, G, T, D;
  int64_t Dp, Tp;  // D and T rounded up to even (the pair-packed layouts' padding)
  int64_t groups() const { return B * Hkv; }
  int64_t block_rows() const {
    // Even, so every block but the last starts a new pair of rows.
    return std::max<int64_t>(2, (kRowsPerBlock / G) & ~int64_t{1});
  }
};

Dims dims_of(const at::Tensor& q, const at::Tensor& k) {
  Dims n{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), q.size(3), 0, 0};
  n.Dp = n.D + (n.D & 1);
  n.Tp = n.T + (n.T & 1);
  return n;
}

// Scratch carved from one per-thread buffer that only grows: no allocation per task.
class Arena {
 public:
  explicit Arena(size_t bytes) {
    thread_local std::vector<char> buf;
    if (buf.size() < bytes + 64) buf.resize(bytes + 64);
    base_ = buf.data();
    off_ = (64 - reinterpret_cast<uintptr_t>(base_) % 64) % 64;
  }
  template <typename T>
  T* take(int64_t n) {
    T* r = reinterpret_cast<T*>(base_ + off_);
    off_ += (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
    return r;
  }
  static size_t bytes(int64_t n, size_t elem) { return (n * elem + 63) / 64 * 64; }

 private:
  char* base_;
  size_t off_;
};

// out[2 * ((d / 2) * T + t) + d % 2] = x[t, d]: pairs along d (the B of Q K^T and dO V^T).
template <typename S>
void pack_by_d(const View4<S>& x, int64_t b, int64_t h, const Dims& n, S* out) {
  for (int64_t t = 0; t < n.T; ++t) {
    const S* r = x.row(b, h, t);
    for (int64_t d = 0; d < n.Dp; ++d) {
      out[2 * ((d >> 1) * n.T + t) + (d & 1)] = d < n.D ? r[d] : S(0);
    }
  }
}

// out[2 * ((t / 2) * D + d) + t % 2] = x[t, d]: pairs along t (the B of P V and dS K).
template <typename S>
void pack_by_t(const View4<S>& x, int64_t b, int64_t h, const Dims& n, S* out) {
  for (int64_t t = 0; t < n.Tp; ++t) {
    const S* r = t < n.T ? x.row(b, h, t) : nullptr;
    for (int64_t d = 0; d < n.D; ++d) out[2 * ((t >> 1) * n.D + d) + (t & 1)] = r ? r[d] : S(0);
  }
}

template <typename S>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
                  at::Tensor& out, at::Tensor& lse) {
  const Dims n = dims_of(q, k);
  const View4<S> qv = view<S>(q), kv = view<S>(k), vv = view<S>(v);
  S* op = static_cast<S*>(out.data_ptr());
  float* lp = lse.data_ptr<float>();
  std::vector<S> kt(n.groups() * n.Dp * n.T), vn(n.groups() * n.Tp * n.D);
  common::run_tasks(n.groups(), [&](int64_t g) {
    pack_by_d(kv, g / n.Hkv, g % n.Hkv, n, kt.data() + g * n.Dp * n.T);
    pack_by_t(vv, g / n.Hkv, g % n.Hkv, n, vn.data() + g * n.Tp * n.D);
  });
  const int64_t bq = n.block_rows(), nqb = (n.T + bq - 1) / bq;
  const RowFns<S>& fns = row_fns<S>();
  common::run_tasks(n.groups() * nqb, [&](int64_t task) {
    // The last query blocks see the most keys: hand them out first.
    const int64_t g = task / nqb, qb = nqb - 1 - task % nqb;
    const int64_t b = g / n.Hkv, h = g % n.Hkv;
    const int64_t r0 = qb * bq, r1 = std::min(n.T, r0 + bq), rows = r1 - r0, M = n.G * rows;
    Arena arena(Arena::bytes(M * n.Dp, sizeof(S)) + Arena::bytes(M * kKeysFwd, sizeof(S)) +
                Arena::bytes(M * kKeysFwd, 4) + Arena::bytes(M * n.D, 4) +
                2 * Arena::bytes(M, 4));
    S* qp = arena.take<S>(M * n.Dp);
    S* p = arena.take<S>(M * kKeysFwd);
    float* s = arena.take<float>(M * kKeysFwd);
    float* o = arena.take<float>(M * n.D);
    float* m = arena.take<float>(M);
    float* l = arena.take<float>(M);
    for (int64_t gi = 0; gi < n.G; ++gi) {
      for (int64_t i = 0; i < rows; ++i) {
        S* dst = qp + (gi * rows + i) * n.Dp;
        std::memcpy(dst, qv.row(b, h * n.G + gi, r0 + i), n.D * sizeof(S));
        if (n.Dp > n.D) dst[n.D] = S(0);
      }
    }
    std::fill(o, o + M * n.D, 0.0f);
    std::fill(m, m + M, -std::numeric_limits<float>::infinity());
    std::fill(l, l + M, 0.0f);
    const S* ktg = kt.data() + g * n.Dp * n.T;
    const S* vng = vn.data() + g * n.Tp * n.D;
    for (int64_t c0 = 0; c0 < r1; c0 += kKeysFwd) {
      const int64_t N = std::min(kKeysFwd, r1 - c0), Np = N + (N & 1);
      gemm(M, N, n.D, qp, n.Dp, ktg + 2 * c0, n.T, s, N, false);
      for (int64_t row = 0; row < M; ++row) {
        const int64_t nv = std::clamp<int64_t>(r0 + row % rows - c0 + 1, 0, N);
        fns.fwd(s + row * N, nv, Np, scale, m + row, l + row, p + row * Np, o + row * n.D, n.D);
      }
      gemm(M, n.D, N, p, Np, vng + c0 * n.D, n.D, o, n.D, true);
    }
    for (int64_t row = 0; row < M; ++row) {
      const int64_t hq = h * n.G + row / rows, t = r0 + row % rows;
      S* dst = op + ((b * n.Hq + hq) * n.T + t) * n.D;
      const float inv = 1.0f / l[row];
      for (int64_t d = 0; d < n.D; ++d) dst[d] = store_f<S>(o[row * n.D + d] * inv);
      lp[(b * n.Hq + hq) * n.T + t] = m[row] + std::log(l[row]);
    }
  });
}

// Query blocks [bounds[c], bounds[c + 1]) form chunk c; chunks carry about equal causal work.
std::vector<int64_t> chunk_bounds(int64_t nqb, int64_t bq, int64_t T, int64_t chunks) {
  std::vector<int64_t> cum(nqb + 1, 0);
  for (int64_t qb = 0; qb < nqb; ++qb) cum[qb + 1] = cum[qb] + std::min(T, (qb + 1) * bq);
  std::vector<int64_t> bounds(chunks + 1, nqb);
  bounds[0] = 0;
  int64_t qb = 0;
  for (int64_t c = 1; c < chunks; ++c) {
    while (qb < nqb && cum[qb] * chunks < cum[nqb] * c) ++qb;
    bounds[c] = qb;
  }
  return bounds;
}

template <typename S>
void backward_impl(const at::Tensor& go, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, float scale,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const Dims n = dims_of(q, k);
  const View4<S> gv = view<S>(go), qv = view<S>(q), kv = view<S>(k), vv = view<S>(v),
                 ov = view<S>(out);
  const float* lp = lse.data_ptr<float>();
  const int64_t G = n.G, D = n.D, T = n.T;
  std::vector<S> kt(n.groups() * n.Dp * T), vt(n.groups() * n.Dp * T), kn(n.groups() * n.Tp * D);
  common::run_tasks(n.groups(), [&](int64_t g) {
    pack_by_d(kv, g / n.Hkv, g % n.Hkv, n, kt.data() + g * n.Dp * T);
    pack_by_d(vv, g / n.Hkv, g % n.Hkv, n, vt.data() + g * n.Dp * T);
    pack_by_t(kv, g / n.Hkv, g % n.Hkv, n, kn.data() + g * n.Tp * D);
  });
  const int64_t bq = n.block_rows(), nqb = (T + bq - 1) / bq;
  const int64_t threads = common::kernel_threads();
  const int64_t chunks =
      std::clamp<int64_t>((2 * threads + n.groups() - 1) / n.groups(), 1, nqb);
  const std::vector<int64_t> bounds = chunk_bounds(nqb, bq, T, chunks);
  std::vector<float> dkt(n.groups() * chunks * D * T, 0.0f), dvt(dkt.size(), 0.0f);
  S* dqp = static_cast<S*>(dq.data_ptr());
  const RowFns<S>& fns = row_fns<S>();
  common::run_tasks(n.groups() * chunks, [&](int64_t task) {
    const int64_t g = task / chunks, c = task % chunks;
    const int64_t b = g / n.Hkv, h = g % n.Hkv;
    float* dkp = dkt.data() + task * D * T;
    float* dvp = dvt.data() + task * D * T;
    const S* ktg = kt.data() + g * n.Dp * T;
    const S* vtg = vt.data() + g * n.Dp * T;
    const S* kng = kn.data() + g * n.Tp * D;
    const int64_t Mmax = G * bq + 1;
    Arena arena(2 * Arena::bytes(Mmax * n.Dp, sizeof(S)) + 2 * Arena::bytes(D * Mmax, sizeof(S)) +
                3 * Arena::bytes(Mmax * (kKeysBwd + 1), sizeof(S)) +
                2 * Arena::bytes(Mmax * kKeysBwd, 4) + Arena::bytes(Mmax * D, 4) +
                2 * Arena::bytes(Mmax, 4));
    S* qp = arena.take<S>(Mmax * n.Dp);
    S* dop = arena.take<S>(Mmax * n.Dp);
    S* qT = arena.take<S>(D * Mmax);
    S* doT = arena.take<S>(D * Mmax);
    S* p_pair = arena.take<S>(Mmax * (kKeysBwd + 1));
    S* ds_row = arena.take<S>(Mmax * (kKeysBwd + 1));
    S* ds_pair = arena.take<S>(Mmax * (kKeysBwd + 1));
    float* s = arena.take<float>(Mmax * kKeysBwd);
    float* dp = arena.take<float>(Mmax * kKeysBwd);
    float* dqa = arena.take<float>(Mmax * D);
    float* delta = arena.take<float>(Mmax);
    float* lrow = arena.take<float>(Mmax);
    for (int64_t qb = bounds[c]; qb < bounds[c + 1]; ++qb) {
      const int64_t r0 = qb * bq, r1 = std::min(T, r0 + bq), rows = r1 - r0, M = G * rows;
      const int64_t Mp = M + (M & 1);
      for (int64_t row = 0; row < M; ++row) {
        const int64_t hq = h * G + row / rows, t = r0 + row % rows;
        const S* qr = qv.row(b, hq, t);
        const S* gr = gv.row(b, hq, t);
        const S* orow = ov.row(b, hq, t);
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
          qp[row * n.Dp + d] = qr[d];
          dop[row * n.Dp + d] = gr[d];
          qT[d * Mp + row] = qr[d];
          doT[d * Mp + row] = gr[d];
          dot += load_f(gr[d]) * load_f(orow[d]);
        }
        if (n.Dp > D) qp[row * n.Dp + D] = dop[row * n.Dp + D] = S(0);
        delta[row] = dot;
        lrow[row] = lp[(b * n.Hq + hq) * T + t];
      }
      if (Mp > M) {
        for (int64_t d = 0; d < D; ++d) qT[d * Mp + M] = doT[d * Mp + M] = S(0);
      }
      std::fill(dqa, dqa + M * D, 0.0f);
      for (int64_t c0 = 0; c0 < r1; c0 += kKeysBwd) {
        const int64_t N = std::min(kKeysBwd, r1 - c0), Np = N + (N & 1);
        gemm(M, N, D, qp, n.Dp, ktg + 2 * c0, T, s, N, false);
        gemm(M, N, D, dop, n.Dp, vtg + 2 * c0, T, dp, N, false);
        for (int64_t row = 0; row < M; ++row) {
          const int64_t nv = std::clamp<int64_t>(r0 + row % rows - c0 + 1, 0, N);
          const int64_t pair = 2 * ((row >> 1) * N) + (row & 1);
          fns.bwd(s + row * N, dp + row * N, nv, N, Np, scale, lrow[row], delta[row],
                  p_pair + pair, ds_row + row * Np, ds_pair + pair);
        }
        if (Mp > M) {  // the odd last row's partner in its pair is zero
          for (int64_t j = 0; j < N; ++j) {
            p_pair[2 * ((M >> 1) * N + j) + 1] = ds_pair[2 * ((M >> 1) * N + j) + 1] = S(0);
          }
        }
        gemm(D, N, M, doT, Mp, p_pair, N, dvp + c0, T, true);
        gemm(D, N, M, qT, Mp, ds_pair, N, dkp + c0, T, true);
        gemm(M, D, N, ds_row, Np, kng + c0 * D, D, dqa, D, true);
      }
      for (int64_t row = 0; row < M; ++row) {
        const int64_t hq = h * G + row / rows, t = r0 + row % rows;
        S* dst = dqp + ((b * n.Hq + hq) * T + t) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = store_f<S>(dqa[row * D + d]);
      }
    }
  });
  S* dkp = static_cast<S*>(dk.data_ptr());
  S* dvp = static_cast<S*>(dv.data_ptr());
  common::run_tasks(n.groups(), [&](int64_t g) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t d = 0; d < D; ++d) {
        float sk = 0.0f, sv = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
          sk += dkt[((g * chunks + c) * D + d) * T + t];
          sv += dvt[((g * chunks + c) * D + d) * T + t];
        }
        dkp[(g * T + t) * D + d] = store_f<S>(sk);
        dvp[(g * T + t) * D + d] = store_f<S>(sv);
      }
    }
  });
}

// Every entry checks its own inputs: 4-D CPU tensors of one dtype (float32 or bfloat16),
// q [B, Hq, T, D] and k, v [B, Hkv, T, D] with Hq a multiple of Hkv.
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  using Named = std::pair<const char*, const at::Tensor*>;
  for (const auto& [name, x] : std::initializer_list<Named>{{"q", &q}, {"k", &k}, {"v", &v}}) {
    TORCH_CHECK_VALUE(x->defined() && x->dim() == 4, name,
                      " must be a 4-D [batch, heads, tokens, head_dim] tensor, got ",
                      x->defined() ? x->sizes() : at::IntArrayRef{});
    TORCH_CHECK_TYPE(x->device().is_cpu(), name, " must be on the CPU, got ", x->device());
    TORCH_CHECK_TYPE(x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16,
                     name, " must be float32 or bfloat16, got ", x->scalar_type());
    TORCH_CHECK_TYPE(x->scalar_type() == q.scalar_type(), name, " has dtype ",
                     x->scalar_type(), " but q has ", q.scalar_type());
  }
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(),
                    " and ", v.sizes());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3),
                    "k [B, Hkv, T, D] must match q [B, Hq, T, D] in B, T and D, got q ",
                    q.sizes(), " and k ", k.sizes());
  TORCH_CHECK_VALUE(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
                    "q's heads must be a multiple of k's, got ", q.size(1), " and ", k.size(1));
}

at::Tensor last_dim_contiguous(const at::Tensor& x) {
  return x.stride(3) == 1 ? x : x.contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                     const at::Tensor& v_in, double scale) {
  check_qkv(q_in, k_in, v_in);
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite, got ", scale);
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in);
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  if (q.scalar_type() == at::kBFloat16) {
    forward_impl<uint16_t>(q, k, v, static_cast<float>(scale), out, lse);
  } else {
    forward_impl<float>(q, k, v, static_cast<float>(scale), out, lse);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out, const at::Tensor& lse, double scale) {
  check_qkv(q_in, k_in, v_in);
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite, got ", scale);
  using Named = std::pair<const char*, const at::Tensor*>;
  for (const auto& [name, x] : std::initializer_list<Named>{{"grad_out", &grad_out}, {"out", &out}}) {
    TORCH_CHECK_VALUE(x->defined() && x->sizes() == q_in.sizes(), name,
                      " must have q's shape ", q_in.sizes(), ", got ",
                      x->defined() ? x->sizes() : at::IntArrayRef{});
    TORCH_CHECK_TYPE(x->device().is_cpu() && x->scalar_type() == q_in.scalar_type(), name,
                     " must be a CPU ", q_in.scalar_type(), " tensor, got ", x->scalar_type(),
                     " on ", x->device());
  }
  TORCH_CHECK_VALUE(lse.defined() && lse.dim() == 3 && lse.size(0) == q_in.size(0) &&
                        lse.size(1) == q_in.size(1) && lse.size(2) == q_in.size(2),
                    "lse must be the forward's [B, Hq, T] log-sum-exp, got ",
                    lse.defined() ? lse.sizes() : at::IntArrayRef{});
  TORCH_CHECK_TYPE(lse.device().is_cpu() && lse.scalar_type() == at::kFloat,
                   "lse must be a CPU float32 tensor, got ", lse.scalar_type());
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in),
                   v = last_dim_contiguous(v_in), go = last_dim_contiguous(grad_out),
                   o = last_dim_contiguous(out), l = lse.contiguous();
  at::Tensor dq = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dk = at::empty(k.sizes(), k.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dv = at::empty(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  if (q.numel() == 0) return {dq, dk, dv};
  if (q.scalar_type() == at::kBFloat16) {
    backward_impl<uint16_t>(go, q, k, v, o, l, static_cast<float>(scale), dq, dk, dv);
  } else {
    backward_impl<float>(go, q, k, v, o, l, static_cast<float>(scale), dq, dk, dv);
  }
  return {dq, dk, dv};
}

}  // namespace attention
}  // namespace kt_kernel

TORCH_LIBRARY_FRAGMENT(kt_kernel, m) {
  m.def("attention_forward", &kt_kernel::attention::attention_forward);
  m.def("attention_backward", &kt_kernel::attention::attention_backward);
  m.def("attention_isa", []() { return std::string(kt_kernel::attention::gemm_isa()); });
}
