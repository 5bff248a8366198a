// Routed SwiGLU experts over a weight-only INT8 base (per-output-channel fp32 scales), with
// LoRA in the compute dtype (fp32 or bf16): forward and backward on CPU.
//
// The structure follows moe_kernel.cpp (counting sort by expert, padded row blocks, one
// OpenMP task per (expert, row tile), deterministic scatter), but every base GEMM runs on
// weight tiles dequantised on the fly into a per-thread scratch buffer (2 MiB, see
// tile_elems()): `W x` reads row blocks of W, `dh W` (dx and gh) reads column blocks of the
// same int8 storage. No full-precision copy of an expert, let alone of the model, exists.
//
// The SIMD dequantisation loops live in int8_dequant.cpp. The ops are registered with
// TORCH_LIBRARY_FRAGMENT under `torch.ops.kt_kernel_int8`, so this
// translation unit plugs into the `kt_kernel._C` module without touching its pybind table.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "elementwise.h"
#include "int8_dequant.h"
#include "moe_common.h"

namespace kt_kernel {
namespace int8 {
namespace {

// ------------------------------------------------------------------- tiles and base GEMMs
// Elements per dequantised tile: 1 Mi (2 MiB of bf16; 512 rows of a 2048-wide gate_up, a third
// of one expert). Measured (2 cores, H=2048/I=768/E=64, T=64): 128 Ki tiles ran 10% slower
// than the bf16 base and 1 Mi tiles 8% faster, because each oneDNN call has a fixed cost that
// dominates at few rows. (Fused int8 x bf16 register kernels - vdpbf16ps dot form for W x,
// broadcast-FMA form for dh W - were also tried and measured no faster than oneDNN on
// dequantised tiles.) Overridable for tuning: KT_INT8_TILE_ELEMS.
int64_t tile_elems() {
  static const int64_t v = [] {
    const char* s = std::getenv("KT_INT8_TILE_ELEMS");
    const long long n = s ? std::atoll(s) : 0;
    return n >= 1024 ? static_cast<int64_t>(n) : int64_t{1024 * 1024};
  }();
  return v;
}

// Activation-sized scratch reused across calls (the dense op keeps the same kind of pool):
// fresh multi-MiB buffers are mmapped and page-faulted on first touch every call, which at
// T=2048 costs more than the whole dequantisation. Buffers are handed out under a mutex and
// returned when their Scratch dies; nothing that escapes to Python is ever pooled.
class Pool {
 public:
  at::Tensor take(int64_t bytes) {
    if (bytes <= 0) return at::empty({0}, at::kByte);
    std::lock_guard<std::mutex> lock(mu_);
    int best = -1;
    for (int i = 0; i < static_cast<int>(free_.size()); ++i) {
      const int64_t cap = free_[i].numel();
      if (cap >= bytes && (best < 0 || cap < free_[best].numel())) best = i;
    }
    if (best < 0) return at::empty({bytes}, at::kByte);
    at::Tensor t = free_[best];
    free_.erase(free_.begin() + best);
    return t;
  }
  void give(at::Tensor t) {
    if (t.numel() == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(t));
    if (free_.size() > kMaxFree) {  // drop the smallest
      auto it = std::min_element(free_.begin(), free_.end(), [](const auto& a, const auto& b) {
        return a.numel() < b.numel();
      });
      free_.erase(it);
    }
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    free_.clear();
  }

 private:
  static constexpr size_t kMaxFree = 8;
  std::mutex mu_;
  std::vector<at::Tensor> free_;
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: avoids teardown-order issues at exit
  return *p;
}

// A [rows, cols] tensor of `dtype` over a pooled buffer, returned to the pool on scope exit.
struct Scratch {
  at::Tensor buf, t;
  Scratch(int64_t rows, int64_t cols, at::ScalarType dtype) {
    const int64_t bytes = rows * cols * static_cast<int64_t>(c10::elementSize(dtype));
    buf = pool().take(bytes);
    t = buf.narrow(0, 0, bytes).view(dtype).view({rows, cols});
  }
  ~Scratch() {
    t.reset();
    pool().give(std::move(buf));
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// A per-thread scratch tile; only one is alive per thread at a time (dequantise, GEMM, next).
at::Tensor scratch_tile(int64_t rows, int64_t cols, at::ScalarType dt) {
  thread_local std::vector<char> buf;
  const size_t bytes = static_cast<size_t>(rows * cols) * c10::elementSize(dt);
  if (buf.size() < bytes) buf.resize(bytes);
  return at::from_blob(buf.data(), {rows, cols}, at::TensorOptions().dtype(dt));
}

// Tile extent along one axis: at most about tile_elems() elements per tile, split evenly
// (a multiple of 16) so no thin tail tile is left (e.g. 2048 columns -> 4 x 512, not
// 3 x 672 + 32: a thin GEMM costs nearly as much as a full one).
int64_t tile_extent(int64_t full, int64_t other) {
  const int64_t cap = std::max<int64_t>(16, tile_elems() / std::max<int64_t>(other, 1));
  const int64_t tiles = (full + cap - 1) / cap;
  const int64_t t = ((full + tiles - 1) / tiles + 15) / 16 * 16;
  return std::max<int64_t>(std::min(t, full), 1);
}

// out [m, N] = in [m, K] @ (scale[:, None] * q)^T, q [N, K] int8 (row blocks of q).
void base_nt(at::Tensor out, const at::Tensor& in, const int8_t* q, const float* scale,
             int64_t n_rows, int64_t k) {
  const auto dt = in.scalar_type();
  const int64_t nt = tile_extent(n_rows, k);
  for (int64_t n0 = 0; n0 < n_rows; n0 += nt) {
    const int64_t len = std::min(nt, n_rows - n0);
    at::Tensor tile = scratch_tile(len, k, dt);
    dequant(q + n0 * k, k, scale + n0, len, k, dt, tile.data_ptr(), k);
    at::Tensor o = out.narrow(1, n0, len);
    at::mm_out(o, in, tile.t());
  }
}

// out [m, K] = in [m, N] @ (scale[:, None] * q), q [N, K] int8 (column blocks of q): the
// transposed use of the same storage, for dx and for the gradient into the down input.
void base_nn(at::Tensor out, const at::Tensor& in, const int8_t* q, const float* scale,
             int64_t n_rows, int64_t k) {
  const auto dt = in.scalar_type();
  const int64_t ct = tile_extent(k, n_rows);
  for (int64_t c0 = 0; c0 < k; c0 += ct) {
    const int64_t len = std::min(ct, k - c0);
    at::Tensor tile = scratch_tile(n_rows, len, dt);
    dequant(q + c0, k, scale, n_rows, len, dt, tile.data_ptr(), len);
    at::Tensor o = out.narrow(1, c0, len);
    at::mm_out(o, in, tile);
  }
}

// The int8 base of one layer: q [E, N, K] int8 and scale [E, N] fp32.
struct QBase {
  const int8_t* q;
  const float* s;
  int64_t n, k;
  const int8_t* qe(int64_t e) const { return q + e * n * k; }
  const float* se(int64_t e) const { return s + e * n; }
};

QBase make_base(const at::Tensor& q, const at::Tensor& s, const char* name) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 3 && q.is_contiguous(), name,
              " must be a contiguous int8 [E, N, K] tensor, got ", q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 2 && s.is_contiguous() &&
                  s.size(0) == q.size(0) && s.size(1) == q.size(1),
              name, "_scale must be a contiguous float32 [E, N] tensor matching ", name);
  return {q.data_ptr<int8_t>(), s.data_ptr<float>(), q.size(1), q.size(2)};
}

// ---------------------------------------------------------------- routing and scheduling
// Rows of each expert start at a multiple of kPad and are zero-padded to one, so GEMM shapes
// come from a small set (oneDNN caches one JIT primitive per shape). Padding rows carry zero
// input and zero routing weight, so they change no result. 8 rather than the dense op's 16:
// at small T an expert holds ~8 rows, and padding them to 16 measured ~5% slower here.
constexpr int64_t kPad = 8;

using common::Lora;
using common::Routing;
using common::Task;
using common::gather_rows;
using common::make_tasks;
using common::prepare_lora;
using common::run_tasks;
using common::scatter;
using common::silu_mul;
using common::silu_mul_bwd;

Routing route(const at::Tensor& ids, int64_t num_experts) {
  return common::route(ids, num_experts, kPad);
}

// gu = xs @ W_gu[e]^T (+ s * (xs @ A_cat^T) @ B_bd^T, keeping z = xs @ A_cat^T).
void gate_up_rows(const at::Tensor& xs, const QBase& gu_b, const Lora& l, int64_t e,
                  at::Tensor& gu, at::Tensor* z) {
  base_nt(gu, xs, gu_b.qe(e), gu_b.se(e), gu_b.n, gu_b.k);
  if (l.on) {
    at::mm_out(*z, xs, l.a_cat[e].t());
    gu.addmm_(*z, l.b_bd[e].t(), 1.0, l.s);
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int8 base: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == at::kFloat, "int8 base: topk_weights must be float32, got ",
              w.scalar_type());
}

std::tuple<at::Tensor, std::vector<at::Tensor>> forward(
    at::Tensor x, at::Tensor ids, at::Tensor w, at::Tensor gate_up_q, at::Tensor gate_up_scale,
    at::Tensor down_q, at::Tensor down_scale, std::vector<at::Tensor> lora_t, double scaling,
    bool fused, bool save, int64_t tile_rows) {
  at::NoGradGuard no_grad;
  x = x.detach().contiguous();
  ids = ids.detach().contiguous();
  w = w.detach().contiguous();
  check_inputs(x, w);
  for (auto& t : lora_t) t = t.detach();
  TORCH_CHECK(tile_rows > 0 && tile_rows % kPad == 0, "tile_rows must be a multiple of ", kPad);
  const QBase gub = make_base(gate_up_q, gate_up_scale, "gate_up");
  const QBase dnb = make_base(down_q, down_scale, "down");
  const int64_t tokens = x.size(0), hidden = x.size(1), k = ids.size(1);
  const int64_t num_experts = gate_up_q.size(0), inter = down_q.size(2);
  TORCH_CHECK(gub.k == hidden && gub.n == 2 * inter && dnb.n == hidden, "int8 base shapes ",
              gate_up_q.sizes(), " / ", down_q.sizes(), " do not match x ", x.sizes());
  Routing rt = route(ids, num_experts);
  Lora l = prepare_lora(lora_t, fused, scaling, inter);
  const int64_t ra = l.on ? l.a_cat.size(1) : 0;
  const int64_t np = rt.perm.numel();
  auto opts = x.options();
  const auto dt = x.scalar_type();
  Scratch xs_s(np, hidden, dt), out_s(np, hidden, dt), gu_s(save ? 0 : np, 2 * inter, dt);
  at::Tensor xs = xs_s.t, out = out_s.t;
  at::Tensor gu = save ? at::empty({np, 2 * inter}, opts) : gu_s.t;
  at::Tensor z = l.on ? at::empty({np, ra}, opts) : at::empty({0}, opts);
  at::Tensor zd = l.on ? at::empty({np, l.rank}, opts) : at::empty({0}, opts);
  const int64_t* perm = rt.perm.data_ptr<int64_t>();
  std::vector<Task> tasks = make_tasks(rt.offsets, tile_rows);
  run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const Task& tk = tasks[i];
    const int64_t b = tk.begin, m = tk.end - tk.begin, e = tk.expert;
    gather_rows(x, perm, k, b, tk.end, xs);
    at::Tensor xs_t = xs.narrow(0, b, m);
    at::Tensor gu_t = gu.narrow(0, b, m);
    at::Tensor z_t = l.on ? z.narrow(0, b, m) : at::Tensor();
    gate_up_rows(xs_t, gub, l, e, gu_t, &z_t);
    at::Tensor h_t = at::empty({m, inter}, opts);
    silu_mul(gu_t, h_t);
    at::Tensor o_t = out.narrow(0, b, m);
    base_nt(o_t, h_t, dnb.qe(e), dnb.se(e), dnb.n, dnb.k);
    if (l.on) {
      at::Tensor zd_t = zd.narrow(0, b, m);
      at::mm_out(zd_t, h_t, l.a_down[e].t());
      o_t.addmm_(zd_t, l.b_down[e].t(), 1.0, l.s);
    }
  });
  at::Tensor y = scatter(out, rt.pos, w, tokens, k);
  std::vector<at::Tensor> saved = {rt.perm, rt.pos, rt.offsets};
  if (save) {
    saved.push_back(gu);
    saved.push_back(z);
    saved.push_back(zd);
  }
  return {y, saved};
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> backward(
    at::Tensor dy, at::Tensor x, at::Tensor ids, at::Tensor w, at::Tensor gate_up_q,
    at::Tensor gate_up_scale, at::Tensor down_q, at::Tensor down_scale,
    std::vector<at::Tensor> lora_t, double scaling, bool fused, std::vector<at::Tensor> saved,
    bool need_dx, int64_t tile_rows) {
  at::NoGradGuard no_grad;
  dy = dy.detach().contiguous();
  x = x.detach().contiguous();
  check_inputs(x, w);
  for (auto& t : lora_t) t = t.detach();
  TORCH_CHECK(tile_rows > 0 && tile_rows % kPad == 0, "tile_rows must be a multiple of ", kPad);
  TORCH_CHECK(saved.size() == 3 || saved.size() == 6, "corrupt saved state");
  const QBase gub = make_base(gate_up_q, gate_up_scale, "gate_up");
  const QBase dnb = make_base(down_q, down_scale, "down");
  const int64_t tokens = x.size(0), hidden = x.size(1), k = ids.size(1);
  const int64_t num_experts = gate_up_q.size(0), inter = down_q.size(2);
  Routing rt{saved[0], saved[1], saved[2]};
  const bool have_saved = saved.size() == 6;
  Lora l = prepare_lora(lora_t, fused, scaling, inter);
  const int64_t ra = l.on ? l.a_cat.size(1) : 0, r = l.rank;
  auto opts = x.options();
  const int64_t* perm = rt.perm.data_ptr<int64_t>();
  const int64_t np = rt.perm.numel();
  // Per-row routing weight in sorted order (0 on padding rows), and the per-row dw.
  at::Tensor w_flat = w.reshape({-1}).contiguous();
  at::Tensor w_rows = at::zeros({np}, w.options());
  {
    const float* src = w_flat.data_ptr<float>();
    float* dst = w_rows.data_ptr<float>();
    for (int64_t p = 0; p < np; ++p) {
      if (perm[p] >= 0) dst[p] = src[perm[p]];
    }
  }
  at::Tensor dw_rows = at::empty({np}, w.options());
  const bool need_xs = l.on || !have_saved;
  const auto dt = x.scalar_type();
  Scratch xs_s(need_xs ? np : 0, hidden, dt), dys_s(np, hidden, dt), dgu_s(np, 2 * inter, dt);
  Scratch dxs_s(need_dx ? np : 0, hidden, dt), h_s(l.on ? np : 0, inter, dt);
  at::Tensor xs = need_xs ? xs_s.t : at::Tensor();
  at::Tensor dys = dys_s.t;
  at::Tensor dgu = dgu_s.t;
  at::Tensor dxs = need_dx ? dxs_s.t : at::Tensor();
  at::Tensor h = l.on ? h_s.t : at::Tensor();
  at::Tensor z = have_saved ? saved[4] : (l.on ? at::empty({np, ra}, opts) : at::Tensor());
  at::Tensor zd = have_saved ? saved[5] : (l.on ? at::empty({np, r}, opts) : at::Tensor());
  at::Tensor q = l.on ? at::empty({np, r}, opts) : at::Tensor();
  at::Tensor dz = l.on ? at::empty({np, ra}, opts) : at::Tensor();
  std::vector<Task> tasks = make_tasks(rt.offsets, tile_rows);
  run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const Task& tk = tasks[i];
    const int64_t b = tk.begin, m = tk.end - tk.begin, e = tk.expert;
    at::Tensor gu_t;
    if (need_xs) gather_rows(x, perm, k, b, tk.end, xs);
    if (have_saved) {
      gu_t = saved[3].narrow(0, b, m);
    } else {
      gu_t = at::empty({m, 2 * inter}, opts);
      at::Tensor z_t = l.on ? z.narrow(0, b, m) : at::Tensor();
      gate_up_rows(xs.narrow(0, b, m), gub, l, e, gu_t, &z_t);
    }
    gather_rows(dy, perm, k, b, tk.end, dys);
    at::Tensor dys_t = dys.narrow(0, b, m);
    at::Tensor gh_t = at::empty({m, inter}, opts);
    base_nn(gh_t, dys_t, dnb.qe(e), dnb.se(e), dnb.n, dnb.k);
    if (l.on) {
      at::Tensor q_t = q.narrow(0, b, m);
      at::mm_out(q_t, dys_t, l.b_down[e]);
      gh_t.addmm_(q_t, l.a_down[e], 1.0, l.s);
    }
    at::Tensor dgu_t = dgu.narrow(0, b, m);
    at::Tensor h_t = l.on ? h.narrow(0, b, m) : at::empty({m, inter}, opts);
    at::Tensor dw_t = dw_rows.narrow(0, b, m);
    silu_mul_bwd(gu_t, gh_t, w_rows.narrow(0, b, m), dgu_t, h_t, dw_t);
    if (l.on) {
      if (!have_saved) {
        at::Tensor zd_t = zd.narrow(0, b, m);
        at::mm_out(zd_t, h_t, l.a_down[e].t());
      }
      at::Tensor dz_t = dz.narrow(0, b, m);
      at::mm_out(dz_t, dgu_t, l.b_bd[e]);
    }
    if (need_dx) {
      at::Tensor dxs_t = dxs.narrow(0, b, m);
      base_nn(dxs_t, dgu_t, gub.qe(e), gub.se(e), gub.n, gub.k);
      if (l.on) dxs_t.addmm_(dz.narrow(0, b, m), l.a_cat[e], 1.0, l.s);
    }
  });

  std::vector<at::Tensor> grads;
  if (l.on) {
    // LoRA weight gradients: one GEMM per expert over all its rows (a fixed reduction order).
    at::Tensor w_col = w_rows.to(opts.dtype()).unsqueeze(1);
    at::Tensor qw = q * w_col;
    at::Tensor zdw = zd * w_col;
    at::Tensor d_acat = at::zeros_like(l.a_cat);
    at::Tensor d_bbd = fused ? at::zeros_like(l.b_bd) : at::Tensor();
    at::Tensor d_bg = fused ? at::Tensor() : at::zeros({num_experts, inter, r}, opts);
    at::Tensor d_bu = fused ? at::Tensor() : at::zeros({num_experts, inter, r}, opts);
    at::Tensor d_ad = at::zeros_like(l.a_down);
    at::Tensor d_bd = at::zeros_like(l.b_down);
    const int64_t* off = rt.offsets.data_ptr<int64_t>();
    run_tasks(num_experts, [&](int64_t e) {
      const int64_t b = off[e], m = off[e + 1] - off[e];
      if (m == 0) return;
      at::Tensor d_bd_e = d_bd[e], d_ad_e = d_ad[e], d_acat_e = d_acat[e];
      d_bd_e.addmm_(dys.narrow(0, b, m).t(), zdw.narrow(0, b, m), 0.0, l.s);
      d_ad_e.addmm_(qw.narrow(0, b, m).t(), h.narrow(0, b, m), 0.0, l.s);
      at::Tensor dgu_e = dgu.narrow(0, b, m), z_e = z.narrow(0, b, m);
      if (fused) {
        d_bbd[e].addmm_(dgu_e.t(), z_e, 0.0, l.s);
      } else {
        d_bg[e].addmm_(dgu_e.narrow(1, 0, inter).t(), z_e.narrow(1, 0, r), 0.0, l.s);
        d_bu[e].addmm_(dgu_e.narrow(1, inter, inter).t(), z_e.narrow(1, r, r), 0.0, l.s);
      }
      d_acat_e.addmm_(dz.narrow(0, b, m).t(), xs.narrow(0, b, m), 0.0, l.s);
    });
    if (fused) {
      grads = {d_acat, d_bbd, d_ad, d_bd};
    } else {
      grads = {d_acat.narrow(1, 0, r), d_bg, d_acat.narrow(1, r, r), d_bu, d_ad, d_bd};
    }
  }
  at::Tensor dx = need_dx ? scatter(dxs, rt.pos, at::Tensor(), tokens, k) : at::Tensor();
  at::Tensor dw = dw_rows.index_select(0, rt.pos).reshape({tokens, k});
  return {dx, dw, grads};
}

// The whole [E, N, K] tensor dequantised: for tests of the SIMD tile loop against the Python
// reference only; the op itself never builds this.
at::Tensor dequantize(at::Tensor q, at::Tensor scale, at::ScalarType dtype) {
  const QBase b = make_base(q, scale, "q");
  at::Tensor out = at::empty(q.sizes(), at::TensorOptions().dtype(dtype));
  const int64_t e_count = q.size(0);
  for (int64_t e = 0; e < e_count; ++e) {
    char* dst = static_cast<char*>(out.data_ptr()) + e * b.n * b.k * out.element_size();
    dequant(b.qe(e), b.k, b.se(e), b.n, b.k, dtype, dst, b.k);
  }
  return out;
}

// One column block, exercising the strided (transposed-use) path and the masked tails.
at::Tensor dequantize_columns(at::Tensor q, at::Tensor scale, int64_t c0, int64_t cols,
                              at::ScalarType dtype) {
  const QBase b = make_base(q, scale, "q");
  TORCH_CHECK(c0 >= 0 && cols > 0 && c0 + cols <= b.k, "column block out of range");
  at::Tensor out = at::empty({q.size(0), b.n, cols}, at::TensorOptions().dtype(dtype));
  for (int64_t e = 0; e < q.size(0); ++e) {
    char* dst = static_cast<char*>(out.data_ptr()) + e * b.n * cols * out.element_size();
    dequant(b.qe(e) + c0, b.k, b.se(e), b.n, cols, dtype, dst, cols);
  }
  return out;
}

std::string isa() { return dequant_isa(); }

// Frees the pooled activation scratch (the dense op's `kt_kernel._C.release_scratch` twin).
void release_scratch() { pool().clear(); }

}  // namespace
}  // namespace int8
}  // namespace kt_kernel

TORCH_LIBRARY_FRAGMENT(kt_kernel_int8, m) {
  m.def("forward", &kt_kernel::int8::forward);
  m.def("backward", &kt_kernel::int8::backward);
  m.def("dequantize", &kt_kernel::int8::dequantize);
  m.def("dequantize_columns", &kt_kernel::int8::dequantize_columns);
  m.def("isa", &kt_kernel::int8::isa);
  m.def("release_scratch", &kt_kernel::int8::release_scratch);
}
