// Routed SwiGLU experts with LoRA: forward and backward on CPU.
//
// Layout of one call: a counting sort groups the T*k (token, slot) pairs by expert; work is
// cut into (expert, row tile) tasks run over OpenMP threads, each doing its GEMMs with ATen
// (MKL / oneDNN) single-threaded on contiguous gathered rows. Every output element is
// produced by exactly one task and every reduction runs in a fixed order, so results are
// bitwise independent of the thread count and of scheduling.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <ctime>
#include <exception>
#include <mutex>
#include <optional>
#include <vector>

#include "elementwise.h"
#include "moe_common.h"

namespace kt_kernel {
namespace {

// Per-phase thread CPU time summed over threads (nanoseconds), read by profile() for the benchmark.
enum Phase {
  kRoute, kPrep, kGather, kGemmGateUp, kLoraGateUp, kSilu, kGemmDown, kLoraDown, kScatter,
  kBwdGemmDown, kBwdLoraDown, kSiluBwd, kBwdLoraGateUp, kBwdGemmGateUp, kWeightGrad,
  kBwdScatter, kRecompute, kPhaseCount
};
const char* kPhaseNames[] = {
    "route", "prepare_lora", "gather", "gemm_gate_up", "lora_gate_up", "silu_mul",
    "gemm_down", "lora_down", "scatter", "bwd_gemm_down", "bwd_lora_down", "silu_mul_bwd",
    "bwd_lora_gate_up", "bwd_gemm_gate_up", "lora_weight_grad", "bwd_scatter", "recompute"};
std::atomic<int64_t> g_phase_ns[kPhaseCount];

// Thread CPU time, not wall time: on a shared machine it measures the work, not the waiting.
inline int64_t thread_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

struct Timer {
  Phase phase;
  int64_t t0 = thread_ns();
  explicit Timer(Phase p) : phase(p) {}
  ~Timer() { g_phase_ns[phase] += thread_ns() - t0; }
};
#define KT_TIME(p) Timer kt_timer_##p(p)

// Each expert's rows start at a multiple of kPad and its block is zero-padded to one, so every
// GEMM sees M (and, for the LoRA weight gradients, K) in {kPad, 2*kPad, ..., tile}. oneDNN
// JIT-compiles and caches one primitive per distinct shape (~0.75 MiB each); unpadded
// routing would create a new one for almost every call. Padded rows are exact zeros all
// the way through (zero input, zero routing weight), so they change no result.
constexpr int64_t kPad = 16;

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

// Scratch buffers reused across calls. Fresh multi-MiB allocations are mmapped and every
// first touch page-faults (serialising threads on the mm lock); reusing them avoids that.
// Buffers are taken out under a mutex and handed back when the Scratch dies, so concurrent
// calls never share one. Nothing that escapes to Python is ever pooled.
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

// A [rows, cols] tensor of `dtype` viewing a pooled buffer, returned to the pool on scope exit.
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


// gu = xs @ W_gu[e]^T (+ s * (xs @ A_cat^T) @ B_bd^T, keeping z = xs @ A_cat^T).
void gate_up_rows(const at::Tensor& xs, const at::Tensor& gate_up, const Lora& l, int64_t e,
                  at::Tensor& gu, at::Tensor* z) {
  {
    KT_TIME(kGemmGateUp);
    at::mm_out(gu, xs, gate_up[e].t());
  }
  if (l.on) {
    KT_TIME(kLoraGateUp);
    at::mm_out(*z, xs, l.a_cat[e].t());
    gu.addmm_(*z, l.b_bd[e].t(), 1.0, l.s);
  }
}

std::tuple<at::Tensor, std::vector<at::Tensor>> forward(
    at::Tensor x, at::Tensor ids, at::Tensor w, at::Tensor gate_up, at::Tensor down,
    std::vector<at::Tensor> lora_t, double scaling, bool fused, bool save, int64_t tile_rows) {
  at::NoGradGuard no_grad;
  x = x.detach().contiguous();
  ids = ids.detach().contiguous();
  w = w.detach().contiguous();
  for (auto& t : lora_t) t = t.detach();
  const int64_t tokens = x.size(0), hidden = x.size(1), k = ids.size(1);
  const int64_t num_experts = gate_up.size(0), inter = down.size(2);
  TORCH_CHECK(tile_rows > 0 && tile_rows % kPad == 0, "tile_rows must be a multiple of ", kPad);
  Routing rt = [&] {
    KT_TIME(kRoute);
    return route(ids, num_experts);
  }();
  Lora l = [&] {
    KT_TIME(kPrep);
    return prepare_lora(lora_t, fused, scaling, inter);
  }();
  const int64_t ra = l.on ? l.a_cat.size(1) : 0;
  const int64_t np = rt.perm.numel();  // padded row count
  auto opts = x.options();
  const auto dt = x.scalar_type();
  Scratch xs_s(np, hidden, dt), out_s(np, hidden, dt);
  std::optional<Scratch> gu_s;
  if (!save) gu_s.emplace(np, 2 * inter, dt);
  at::Tensor xs = xs_s.t, out = out_s.t;
  at::Tensor gu = save ? at::empty({np, 2 * inter}, opts) : gu_s->t;
  at::Tensor z = l.on ? at::empty({np, ra}, opts) : at::empty({0}, opts);
  at::Tensor zd = l.on ? at::empty({np, l.rank}, opts) : at::empty({0}, opts);
  const int64_t* perm = rt.perm.data_ptr<int64_t>();
  std::vector<Task> tasks = make_tasks(rt.offsets, tile_rows);
  run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const Task& tk = tasks[i];
    const int64_t b = tk.begin, m = tk.end - tk.begin, e = tk.expert;
    {
      KT_TIME(kGather);
      gather_rows(x, perm, k, b, tk.end, xs);
    }
    at::Tensor xs_t = xs.narrow(0, b, m);
    at::Tensor gu_t = gu.narrow(0, b, m);
    at::Tensor z_t = l.on ? z.narrow(0, b, m) : at::Tensor();
    gate_up_rows(xs_t, gate_up, l, e, gu_t, &z_t);
    at::Tensor h_t = at::empty({m, inter}, opts);
    {
      KT_TIME(kSilu);
      silu_mul(gu_t, h_t);
    }
    at::Tensor o_t = out.narrow(0, b, m);
    {
      KT_TIME(kGemmDown);
      at::mm_out(o_t, h_t, down[e].t());
    }
    if (l.on) {
      KT_TIME(kLoraDown);
      at::Tensor zd_t = zd.narrow(0, b, m);
      at::mm_out(zd_t, h_t, l.a_down[e].t());
      o_t.addmm_(zd_t, l.b_down[e].t(), 1.0, l.s);
    }
  });
  at::Tensor y = [&] {
    KT_TIME(kScatter);
    return scatter(out, rt.pos, w, tokens, k);
  }();
  std::vector<at::Tensor> saved = {rt.perm, rt.pos, rt.offsets};
  if (save) {
    saved.push_back(gu);
    saved.push_back(z);
    saved.push_back(zd);
  }
  return {y, saved};
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> backward(
    at::Tensor dy, at::Tensor x, at::Tensor ids, at::Tensor w, at::Tensor gate_up,
    at::Tensor down, std::vector<at::Tensor> lora_t, double scaling, bool fused,
    std::vector<at::Tensor> saved, bool need_dx, int64_t tile_rows) {
  at::NoGradGuard no_grad;
  dy = dy.detach().contiguous();
  for (auto& t : lora_t) t = t.detach();
  const int64_t tokens = x.size(0), hidden = x.size(1), k = ids.size(1);
  const int64_t num_experts = gate_up.size(0), inter = down.size(2);
  TORCH_CHECK(tile_rows > 0 && tile_rows % kPad == 0, "tile_rows must be a multiple of ", kPad);
  TORCH_CHECK(saved.size() == 3 || saved.size() == 6, "corrupt saved state");
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
  AT_DISPATCH_FLOATING_TYPES(w.scalar_type(), "kt_w_rows", [&] {
    const scalar_t* src = w_flat.data_ptr<scalar_t>();
    scalar_t* dst = w_rows.data_ptr<scalar_t>();
    for (int64_t p = 0; p < np; ++p) {
      if (perm[p] >= 0) dst[p] = src[perm[p]];
    }
  });
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
    if (need_xs) {
      KT_TIME(kGather);
      gather_rows(x, perm, k, b, tk.end, xs);
    }
    if (have_saved) {
      gu_t = saved[3].narrow(0, b, m);
    } else {
      KT_TIME(kRecompute);
      gu_t = at::empty({m, 2 * inter}, opts);
      at::Tensor z_t = l.on ? z.narrow(0, b, m) : at::Tensor();
      gate_up_rows(xs.narrow(0, b, m), gate_up, l, e, gu_t, &z_t);
    }
    {
      KT_TIME(kGather);
      gather_rows(dy, perm, k, b, tk.end, dys);
    }
    at::Tensor dys_t = dys.narrow(0, b, m);
    at::Tensor gh_t = at::empty({m, inter}, opts);
    {
      KT_TIME(kBwdGemmDown);
      at::mm_out(gh_t, dys_t, down[e]);
    }
    if (l.on) {
      KT_TIME(kBwdLoraDown);
      at::Tensor q_t = q.narrow(0, b, m);
      at::mm_out(q_t, dys_t, l.b_down[e]);
      gh_t.addmm_(q_t, l.a_down[e], 1.0, l.s);
    }
    at::Tensor dgu_t = dgu.narrow(0, b, m);
    at::Tensor h_t = l.on ? h.narrow(0, b, m) : at::empty({m, inter}, opts);
    at::Tensor dw_t = dw_rows.narrow(0, b, m);
    {
      KT_TIME(kSiluBwd);
      silu_mul_bwd(gu_t, gh_t, w_rows.narrow(0, b, m), dgu_t, h_t, dw_t);
    }
    if (l.on) {
      KT_TIME(kBwdLoraGateUp);
      if (!have_saved) {
        at::Tensor zd_t = zd.narrow(0, b, m);
        at::mm_out(zd_t, h_t, l.a_down[e].t());
      }
      at::Tensor dz_t = dz.narrow(0, b, m);
      at::mm_out(dz_t, dgu_t, l.b_bd[e]);
    }
    if (need_dx) {
      KT_TIME(kBwdGemmGateUp);
      at::Tensor dxs_t = dxs.narrow(0, b, m);
      at::mm_out(dxs_t, dgu_t, gate_up[e]);
      if (l.on) dxs_t.addmm_(dz.narrow(0, b, m), l.a_cat[e], 1.0, l.s);
    }
  });

  std::vector<at::Tensor> grads;
  if (l.on) {
    KT_TIME(kWeightGrad);
    // Weight gradients: one GEMM per expert over all of its rows (a fixed reduction order).
    at::Tensor w_col = w_rows.to(opts.dtype()).unsqueeze(1);
    at::Tensor qw = q * w_col;    // dL/d(A_down h) / s, per row
    at::Tensor zdw = zd * w_col;  // routing weight folded into the down LoRA input
    at::Tensor d_acat = at::zeros_like(l.a_cat);
    at::Tensor d_bbd = fused ? at::zeros_like(l.b_bd) : at::Tensor();
    at::Tensor d_bg = fused ? at::Tensor() : at::zeros({num_experts, inter, r}, opts);
    at::Tensor d_bu = fused ? at::Tensor() : at::zeros({num_experts, inter, r}, opts);
    at::Tensor d_ad = at::zeros_like(l.a_down);
    at::Tensor d_bd = at::zeros_like(l.b_down);
    const int64_t* off = rt.offsets.data_ptr<int64_t>();
    run_tasks(num_experts, [&](int64_t e) {
      // Row tiles of one expert are summed in order into its gradients (fixed K per GEMM).
      at::Tensor d_bd_e = d_bd[e], d_ad_e = d_ad[e], d_acat_e = d_acat[e];
      at::Tensor d_bbd_e = fused ? d_bbd[e] : at::Tensor();
      at::Tensor d_bg_e = fused ? at::Tensor() : d_bg[e];
      at::Tensor d_bu_e = fused ? at::Tensor() : d_bu[e];
      for (int64_t b = off[e]; b < off[e + 1]; b += tile_rows) {
        const int64_t m = std::min(tile_rows, off[e + 1] - b);
        at::Tensor dgu_t = dgu.narrow(0, b, m), z_t = z.narrow(0, b, m);
        d_bd_e.addmm_(dys.narrow(0, b, m).t(), zdw.narrow(0, b, m), 1.0, l.s);
        d_ad_e.addmm_(qw.narrow(0, b, m).t(), h.narrow(0, b, m), 1.0, l.s);
        if (fused) {
          d_bbd_e.addmm_(dgu_t.t(), z_t, 1.0, l.s);
        } else {
          d_bg_e.addmm_(dgu_t.narrow(1, 0, inter).t(), z_t.narrow(1, 0, r), 1.0, l.s);
          d_bu_e.addmm_(dgu_t.narrow(1, inter, inter).t(), z_t.narrow(1, r, r), 1.0, l.s);
        }
        d_acat_e.addmm_(dz.narrow(0, b, m).t(), xs.narrow(0, b, m), 1.0, l.s);
      }
    });
    if (fused) {
      grads = {d_acat, d_bbd, d_ad, d_bd};
    } else {
      grads = {d_acat.narrow(1, 0, r), d_bg, d_acat.narrow(1, r, r), d_bu, d_ad, d_bd};
    }
  }
  KT_TIME(kBwdScatter);
  at::Tensor dx = need_dx ? scatter(dxs, rt.pos, at::Tensor(), tokens, k) : at::Tensor();
  at::Tensor dw = dw_rows.index_select(0, rt.pos).reshape({tokens, k});
  return {dx, dw, grads};
}

std::vector<std::string> cpu_features() {
  std::vector<std::string> out;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
#define KT_FEATURE(nm) \
  if (__builtin_cpu_supports(nm)) out.emplace_back(nm);
  KT_FEATURE("avx2")
  KT_FEATURE("fma")
  KT_FEATURE("avx512f")
  KT_FEATURE("avx512bw")
  KT_FEATURE("avx512vl")
  KT_FEATURE("avx512dq")
  KT_FEATURE("avx512bf16")
  KT_FEATURE("avx512vnni")
#undef KT_FEATURE
#endif
  return out;
}

std::vector<std::pair<std::string, double>> profile(bool reset) {
  std::vector<std::pair<std::string, double>> out;
  for (int i = 0; i < kPhaseCount; ++i) {
    out.emplace_back(kPhaseNames[i], g_phase_ns[i].load() * 1e-9);
    if (reset) g_phase_ns[i] = 0;
  }
  return out;
}

}  // namespace
}  // namespace kt_kernel

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kt-kernel native MoE expert forward/backward";
  m.def("forward", &kt_kernel::forward, "expert op forward");
  m.def("backward", &kt_kernel::backward, "expert op backward");
  m.def("isa", []() { return std::string(kt_kernel::kernels().isa); });
  m.def("cpu_features", &kt_kernel::cpu_features);
  m.def("release_scratch", []() { kt_kernel::pool().clear(); },
        "free the scratch buffers kept between calls");
  m.def("profile", &kt_kernel::profile, "per-phase seconds summed over threads",
        pybind11::arg("reset") = false);
  m.def("torch_version", []() { return std::string(TORCH_VERSION); });
}
