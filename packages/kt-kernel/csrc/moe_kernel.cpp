// Routed gated experts with LoRA over any registered weight format: forward and backward on
// CPU. ONE op for every format (formats.h) and activation (elementwise.h), registered once
// with TORCH_LIBRARY as torch.ops.kt_kernel.*; every entry validates its own inputs, so a
// direct call with inconsistent tensors raises (naming the argument) instead of reading out
// of bounds.
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
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <ctime>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <vector>

#include "elementwise.h"
#include "formats.h"
#include "lora_products.h"
#include "moe_common.h"

namespace kt_kernel {
namespace {

// Per-phase thread CPU time summed over threads (nanoseconds), read by profile() for the benchmark.
enum Phase {
  kRoute, kPrep, kGather, kGemmGateUp, kLoraGateUp, kAct, kGemmDown, kLoraDown, kScatter,
  kBwdGemmDown, kBwdLoraDown, kActBwd, kBwdLoraGateUp, kBwdGemmGateUp, kWeightGrad,
  kBwdScatter, kRecompute, kDequant, kSetup, kPhaseCount
};
const char* kPhaseNames[] = {
    "route", "prepare_lora", "gather", "gemm_gate_up", "lora_gate_up", "activation",
    "gemm_down", "lora_down", "scatter", "bwd_gemm_down", "bwd_lora_down", "activation_bwd",
    "bwd_lora_gate_up", "bwd_gemm_gate_up", "lora_weight_grad", "bwd_scatter", "recompute",
    "dequantize",  // the tile loaders' part of the gemm phases
    "setup"};      // serial: argument checks, saved-routing check, routing weights per row
std::atomic<int64_t> g_phase_ns[kPhaseCount];

struct Timer {
  Phase phase;
  int64_t t0 = common::thread_ns();
  explicit Timer(Phase p) : phase(p) {}
  ~Timer() { g_phase_ns[phase] += common::thread_ns() - t0; }
};
#define KT_TIME(p) Timer kt_timer_##p(p)

// Thread imbalance of the parallel regions, read by profile_regions() for the benchmark: per
// region, summed over calls, the wall time, threads x wall, the threads' summed and largest
// busy (thread CPU) time, and the tail (wall from the first thread's last task end to the last's).
enum Region { kRegFwd, kRegBwd, kRegGrad, kRegionCount };
const char* kRegionNames[] = {"forward_tasks", "backward_tasks", "lora_weight_grad"};
const char* kRegionFields[] = {"calls", "threads", "wall", "slots", "busy", "max_busy", "tail"};
constexpr int kRegionFieldCount = 7;
std::atomic<int64_t> g_region[kRegionCount][kRegionFieldCount];

inline int64_t wall_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// common::run_tasks with the region's per-thread busy time recorded (two clock reads per task).
template <typename Fn>
void run_region(Region rg, int64_t n, const Fn& fn) {
  if (n == 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(common::kernel_threads(), n));
  std::vector<int64_t> busy(threads, 0), done(threads, 0);
  const int64_t w0 = wall_ns();
  common::run_tasks(n, [&](int64_t i) {
    const int tid = omp_get_thread_num();
    const int64_t t0 = common::thread_ns();
    fn(i);
    if (tid < threads) {  // each slot is written by its own thread only
      busy[tid] += common::thread_ns() - t0;
      done[tid] = wall_ns();
    }
  });
  const int64_t wall = wall_ns() - w0;
  int64_t sum = 0, mx = 0, first = std::numeric_limits<int64_t>::max(), last = 0;
  for (int t = 0; t < threads; ++t) {
    sum += busy[t];
    mx = std::max(mx, busy[t]);
    if (done[t] > 0) {
      first = std::min(first, done[t]);
      last = std::max(last, done[t]);
    }
  }
  std::atomic<int64_t>* g = g_region[rg];
  const int64_t vals[kRegionFieldCount] = {
      1, threads, wall, threads * wall, sum, mx, last > 0 ? last - first : 0};
  for (int f = 0; f < kRegionFieldCount; ++f) g[f] += vals[f];
}

using common::Lora;
using common::Projection;
using common::Routing;
using common::Scratch;
using common::Task;
using common::act_bwd;
using common::act_fwd;
using common::gather_rows;
using common::make_tasks;
using common::prepare_lora;
using common::scatter;

// ------------------------------------------------------------------ argument validation
// Every check below guards a pointer the loops read: the op is reachable from any Python
// code as torch.ops.kt_kernel.*, so it trusts nothing the Python wrapper already checked.

// The native activations by id (ActKind, elementwise.h): the Python classes in
// kt_kernel/activations.py carry the same id as `native_id` and the same name.
struct ActInfo {
  const char* name;
  size_t num_params;
  const char* params;  // for messages
};
constexpr ActInfo kActivations[] = {
    {"swiglu", 0, "none"},                      // kSwiGLU
    {"clamped_swiglu", 2, "alpha, limit"},      // kClampedSwiGLU
    {"swiglu_limit", 1, "limit"},               // kSwiGLULimit
    {"gelu_tanh_gated", 0, "none"},             // kGeluTanhGated
};
constexpr int64_t kNumActivations = sizeof(kActivations) / sizeof(kActivations[0]);

Act parse_activation(int64_t id, const std::vector<double>& params) {
  TORCH_CHECK_VALUE(id >= 0 && id < kNumActivations, "activation must be an id in [0, ",
                    kNumActivations, ") (kt_kernel.ACTIVATIONS' native_id), got ", id);
  const ActInfo& info = kActivations[id];
  TORCH_CHECK_VALUE(params.size() == info.num_params, "activation_params for ", info.name,
                    " must hold ", info.num_params, " values (", info.params, "), got ",
                    params.size());
  Act act;
  act.kind = static_cast<int>(id);
  switch (act.kind) {
    case kClampedSwiGLU:
      act.alpha = params[0];
      act.limit = params[1];
      break;
    case kSwiGLULimit:
      act.limit = params[0];
      break;
    default:
      break;
  }
  if (info.num_params > 0) {
    TORCH_CHECK_VALUE(act.limit > 0, "activation_params: limit must be > 0, got ", act.limit);
  }
  return act;
}

std::vector<std::string> activation_names() {
  std::vector<std::string> out;
  for (const ActInfo& a : kActivations) out.emplace_back(a.name);
  return out;
}

const char* const kSplitNames[] = {"gate_lora_a", "gate_lora_b", "up_lora_a",
                                   "up_lora_b",   "down_lora_a", "down_lora_b"};
const char* const kFusedNames[] = {"gate_up_lora_a", "gate_up_lora_b", "down_lora_a",
                                   "down_lora_b"};

void check_lora(const std::vector<at::Tensor>& t, bool fused, int64_t e, int64_t h, int64_t i,
                at::ScalarType dt) {
  if (t.empty()) return;
  const size_t want = fused ? 4 : 6;
  TORCH_CHECK_VALUE(t.size() == want, "lora must hold ", want, " tensors for the ",
                    fused ? "fused" : "split", " layout, got ", t.size());
  const char* const* names = fused ? kFusedNames : kSplitNames;
  for (size_t j = 0; j < want; ++j) {
    TORCH_CHECK_VALUE(t[j].defined() && t[j].dim() == 3, "lora[", j, "] (", names[j],
                      ") must be a 3-D tensor, got ",
                      t[j].defined() ? t[j].sizes() : at::IntArrayRef{});
    TORCH_CHECK_TYPE(t[j].scalar_type() == dt, "lora[", j, "] (", names[j], ") must be ", dt,
                     " (the compute dtype), got ", t[j].scalar_type());
    TORCH_CHECK_VALUE(t[j].device().is_cpu(), "lora[", j, "] (", names[j], ") must be on CPU");
  }
  const int64_t r = t[0].size(1);
  TORCH_CHECK_VALUE(r > 0, "lora[0] (", names[0], ") has rank 0");
  std::vector<std::vector<int64_t>> shapes;
  if (fused) {
    shapes = {{e, r, h}, {e, 2 * i, r}, {e, r, i}, {e, h, r}};
  } else {
    shapes = {{e, r, h}, {e, i, r}, {e, r, h}, {e, i, r}, {e, r, i}, {e, h, r}};
  }
  for (size_t j = 0; j < want; ++j) {
    TORCH_CHECK_VALUE(t[j].sizes() == at::IntArrayRef(shapes[j]), "lora[", j, "] (", names[j],
                      ") must have shape ", at::IntArrayRef(shapes[j]), " (E=", e, ", rank=", r,
                      "), got ", t[j].sizes());
  }
}

// The validated, shared part of a forward or backward call.
struct Call {
  int64_t tokens = 0, hidden = 0, k = 0, experts = 0, inter = 0;
  at::ScalarType dt = at::kFloat;
  const formats::Format* fmt = nullptr;
  Projection gu, dn;
  at::Tensor gu_bias, dn_bias;  // undefined when absent
  Act act;
  at::Tensor x, ids, w;
};

// The row padding of this call: none where every product runs on the format's own routines
// (its gemv_all_rows(), in bf16, small-row products on, LoRA on the kernel's routines), else
// the format's row_pad. Padding exists for oneDNN, which compiles a primitive per shape;
// the own routines take any row count, and a 17-row expert padded to 32 cost 88% more work.
int64_t row_pad(const Call& c, bool lora_on) {
  const bool own = c.fmt->all_rows_here() && common::gemv_rows() > 0 && c.dt == at::kBFloat16 &&
                   (!lora_on || lora::available(c.dt));
  return own ? 1 : c.fmt->row_pad;
}

Call prepare(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w,
             const std::string& format, const std::vector<at::Tensor>& gate_up,
             const std::vector<at::Tensor>& down, const std::optional<at::Tensor>& gate_up_bias,
             const std::optional<at::Tensor>& down_bias, int64_t num_experts,
             int64_t intermediate_size, int64_t activation,
             const std::vector<double>& activation_params, const std::vector<at::Tensor>& lora,
             bool fused, int64_t tile_rows) {
  Call c;
  TORCH_CHECK_VALUE(x.defined() && x.dim() == 2, "x must be a 2-D [T, H] tensor, got ",
                    x.defined() ? x.sizes() : at::IntArrayRef{});
  c.dt = x.scalar_type();
  TORCH_CHECK_TYPE(c.dt == at::kFloat || c.dt == at::kBFloat16 || c.dt == at::kDouble,
                   "x must be float32, bfloat16 or float64, got ", c.dt);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "x must be a CPU tensor, got ", x.device());
  c.tokens = x.size(0);
  c.hidden = x.size(1);
  TORCH_CHECK_VALUE(ids.defined() && ids.dim() == 2 && ids.size(1) >= 1,
                    "topk_ids must be a 2-D [T, k>=1] tensor, got ",
                    ids.defined() ? ids.sizes() : at::IntArrayRef{});
  TORCH_CHECK_TYPE(at::isIntegralType(ids.scalar_type(), false),
                   "topk_ids must be an integer tensor, got ", ids.scalar_type());
  TORCH_CHECK_VALUE(ids.size(0) == c.tokens, "topk_ids has ", ids.size(0),
                    " rows but x has ", c.tokens, " (one row of expert ids per token of x)");
  c.k = ids.size(1);
  const auto w_dt = c.dt == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK_VALUE(w.defined() && w.sizes() == ids.sizes(),
                    "topk_weights must have the shape of topk_ids ", ids.sizes(), ", got ",
                    w.defined() ? w.sizes() : at::IntArrayRef{});
  TORCH_CHECK_TYPE(w.scalar_type() == w_dt, "topk_weights must be ", w_dt, " for x of ", c.dt,
                   ", got ", w.scalar_type());
  TORCH_CHECK_VALUE(num_experts > 0, "num_experts must be > 0, got ", num_experts);
  // 2 * intermediate_size (gate_up's rows) must not wrap.
  TORCH_CHECK_VALUE(intermediate_size > 0 &&
                        intermediate_size <= std::numeric_limits<int64_t>::max() / 2,
                    "intermediate_size must be > 0 and at most 2**62 - 1, got ",
                    intermediate_size);
  c.experts = num_experts;
  c.inter = intermediate_size;
  c.fmt = &formats::find_format(format);
  c.fmt->check(gate_up, c.experts, 2 * c.inter, c.hidden, "gate_up");
  c.fmt->check(down, c.experts, c.hidden, c.inter, "down");
  TORCH_CHECK_VALUE(static_cast<int>(gate_up.size()) == c.fmt->num_parts &&
                        static_cast<int>(down.size()) == c.fmt->num_parts,
                    "format ", format, " takes ", c.fmt->num_parts, " tensors per projection");
  if (c.fmt->load == nullptr) {
    TORCH_CHECK_TYPE(gate_up[0].scalar_type() == c.dt && down[0].scalar_type() == c.dt,
                     "dense gate_up/down must have x's dtype ", c.dt, ", got ",
                     gate_up[0].scalar_type(), " / ", down[0].scalar_type());
  } else {
    TORCH_CHECK_TYPE(c.dt == at::kFloat || c.dt == at::kBFloat16, "format ", format,
                     " computes in float32 or bfloat16; x is ", c.dt);
  }
  c.gu = Projection{c.fmt, gate_up, c.experts, 2 * c.inter, c.hidden};
  c.dn = Projection{c.fmt, down, c.experts, c.hidden, c.inter};
  c.gu.load_ns = c.dn.load_ns = &g_phase_ns[kDequant];
  if (gate_up_bias.has_value() && gate_up_bias->defined()) {
    c.gu_bias = *gate_up_bias;
    TORCH_CHECK_VALUE(c.gu_bias.sizes() == at::IntArrayRef({c.experts, 2 * c.inter}),
                      "gate_up_bias must have shape [E=", c.experts, ", 2I=", 2 * c.inter,
                      "], got ", c.gu_bias.sizes());
    TORCH_CHECK_TYPE(c.gu_bias.scalar_type() == c.dt, "gate_up_bias must be ", c.dt, ", got ",
                     c.gu_bias.scalar_type());
  }
  if (down_bias.has_value() && down_bias->defined()) {
    c.dn_bias = *down_bias;
    TORCH_CHECK_VALUE(c.dn_bias.sizes() == at::IntArrayRef({c.experts, c.hidden}),
                      "down_bias must have shape [E=", c.experts, ", H=", c.hidden, "], got ",
                      c.dn_bias.sizes());
    TORCH_CHECK_TYPE(c.dn_bias.scalar_type() == c.dt, "down_bias must be ", c.dt, ", got ",
                     c.dn_bias.scalar_type());
  }
  c.act = parse_activation(activation, activation_params);
  check_lora(lora, fused, c.experts, c.hidden, c.inter, c.dt);
  TORCH_CHECK_VALUE(tile_rows > 0 && tile_rows % c.fmt->row_pad == 0,
                    "tile_rows must be a positive multiple of ", c.fmt->row_pad, " for format ",
                    format, ", got ", tile_rows);
  c.x = x.detach().contiguous();
  c.ids = ids.detach().to(at::kLong).contiguous();
  c.w = w.detach().contiguous();
  return c;
}

// Saved routing handed back to backward: checked to be a permutation of this call's rows.
Routing check_saved_routing(const std::vector<at::Tensor>& saved, const Call& c, int64_t pad) {
  TORCH_CHECK_VALUE(saved.size() == 3 || saved.size() == 6,
                    "saved must hold 3 or 6 tensors from forward, got ", saved.size());
  const char* names[] = {"saved[0] (perm)", "saved[1] (pos)", "saved[2] (offsets)"};
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK_VALUE(saved[i].defined() && saved[i].dim() == 1 &&
                          saved[i].scalar_type() == at::kLong && saved[i].is_contiguous(),
                      names[i], " must be a contiguous 1-D int64 tensor");
  }
  const int64_t n = c.tokens * c.k, np = saved[0].numel();
  TORCH_CHECK_VALUE(saved[1].numel() == n, "saved[1] (pos) must have T*k=", n, " entries, got ",
                    saved[1].numel());
  TORCH_CHECK_VALUE(saved[2].numel() == c.experts + 1, "saved[2] (offsets) must have E+1=",
                    c.experts + 1, " entries, got ", saved[2].numel());
  const int64_t* off = saved[2].data_ptr<int64_t>();
  TORCH_CHECK_VALUE(off[0] == 0 && off[c.experts] == np, "saved[2] (offsets) must run from 0 to ",
                    np);
  for (int64_t e = 0; e < c.experts; ++e) {
    TORCH_CHECK_VALUE(off[e + 1] >= off[e] && off[e] % pad == 0,
                      "saved[2] (offsets) must be non-decreasing multiples of ", pad);
  }
  const int64_t* perm = saved[0].data_ptr<int64_t>();
  const int64_t* pos = saved[1].data_ptr<int64_t>();
  for (int64_t p = 0; p < np; ++p) {
    TORCH_CHECK_VALUE(perm[p] >= -1 && perm[p] < n, "saved[0] (perm) entry out of range");
  }
  for (int64_t f = 0; f < n; ++f) {
    TORCH_CHECK_VALUE(pos[f] >= 0 && pos[f] < np && perm[pos[f]] == f,
                      "saved[1] (pos) is not the inverse of saved[0] (perm)");
  }
  return Routing{saved[0], saved[1], saved[2]};
}

// The LoRA factors packed for lora::nt where lora::available (else `on` is false and the op
// uses ATen's products): the forward's factors as stored, the backward's transposed.
struct PackedLora {
  bool on = false;
  lora::Packed a_cat, b_bd, a_down, b_down;          // x A^T, z B^T
  lora::Packed a_cat_t, b_bd_t, a_down_t, b_down_t;  // dz A, dgu B
};

// Experts with at least one row: only their factors are packed.
std::vector<uint8_t> experts_with_rows(const at::Tensor& offsets) {
  const int64_t* off = offsets.data_ptr<int64_t>();
  std::vector<uint8_t> used(static_cast<size_t>(offsets.numel() - 1));
  for (size_t e = 0; e < used.size(); ++e) used[e] = off[e + 1] > off[e];
  return used;
}

// `forward_factors` packs what forward (and backward's recompute) reads, `backward_factors`
// what backward's products read.
PackedLora pack_lora(const Lora& l, at::ScalarType dt, const at::Tensor& offsets,
                     bool forward_factors, bool backward_factors) {
  PackedLora p;
  if (!l.on || !lora::available(dt)) return p;
  KT_TIME(kPrep);
  p.on = true;
  const std::vector<uint8_t> used = experts_with_rows(offsets);
  if (forward_factors) {
    p.a_cat = lora::pack(l.a_cat, false, used);
    p.b_bd = lora::pack(l.b_bd, false, used);
    p.a_down = lora::pack(l.a_down, false, used);
    p.b_down = lora::pack(l.b_down, false, used);
  }
  if (backward_factors) {
    p.a_cat_t = lora::pack(l.a_cat, true, used);
    p.b_bd_t = lora::pack(l.b_bd, true, used);
    p.a_down_t = lora::pack(l.a_down, true, used);
    p.b_down_t = lora::pack(l.b_down, true, used);
  }
  return p;
}

// gu = xs @ W_gu[e]^T (+ bias) (+ s * (xs @ A_cat^T) @ B_bd^T, keeping z = xs @ A_cat^T).
void gate_up_rows(const at::Tensor& xs, const Call& c, const Lora& l, const PackedLora& pl,
                  int64_t e, at::Tensor& gu, at::Tensor* z) {
  {
    KT_TIME(kGemmGateUp);
    c.gu.nt(gu, xs, e);
    if (c.gu_bias.defined()) gu.add_(c.gu_bias[e]);
  }
  if (l.on) {
    KT_TIME(kLoraGateUp);
    if (pl.on) {
      lora::nt(xs, pl.a_cat, e, *z, false, 1.0f);
      lora::nt(*z, pl.b_bd, e, gu, true, static_cast<float>(l.s));
    } else {
      at::mm_out(*z, xs, l.a_cat[e].t());
      gu.addmm_(*z, l.b_bd[e].t(), 1.0, l.s);
    }
  }
}

std::tuple<at::Tensor, std::vector<at::Tensor>> forward(
    const at::Tensor& x_in, const at::Tensor& ids_in, const at::Tensor& w_in,
    const std::string& format, const std::vector<at::Tensor>& gate_up,
    const std::vector<at::Tensor>& down, const std::optional<at::Tensor>& gate_up_bias,
    const std::optional<at::Tensor>& down_bias, int64_t num_experts, int64_t intermediate_size,
    int64_t activation, const std::vector<double>& activation_params,
    std::vector<at::Tensor> lora_t, double scaling, bool fused, bool save, int64_t tile_rows) {
  at::NoGradGuard no_grad;
  for (auto& t : lora_t) t = t.defined() ? t.detach() : t;
  const Call c = [&] {
    KT_TIME(kSetup);
    return prepare(x_in, ids_in, w_in, format, gate_up, down, gate_up_bias, down_bias,
                   num_experts, intermediate_size, activation, activation_params, lora_t, fused,
                   tile_rows);
  }();
  const at::Tensor& x = c.x;
  const int64_t tokens = c.tokens, hidden = c.hidden, k = c.k, inter = c.inter;
  Lora l = [&] {
    KT_TIME(kPrep);
    return prepare_lora(lora_t, fused, scaling, inter);
  }();
  Routing rt = [&] {
    KT_TIME(kRoute);
    return common::route(c.ids, c.experts, row_pad(c, l.on));
  }();
  const PackedLora pl = pack_lora(l, c.dt, rt.offsets, true, false);
  const int64_t ra = l.on ? l.a_cat.size(1) : 0;
  const int64_t np = rt.perm.numel();  // padded row count
  auto opts = x.options();
  const auto dt = c.dt;
  Scratch xs_s(np, hidden, dt), out_s(np, hidden, dt), gu_s(save ? 0 : np, 2 * inter, dt);
  at::Tensor xs = xs_s.t, out = out_s.t;
  at::Tensor gu = save ? common::pooled_tensor(np, 2 * inter, dt) : gu_s.t;
  at::Tensor z = l.on ? at::empty({np, ra}, opts) : at::empty({0}, opts);
  at::Tensor zd = l.on ? at::empty({np, l.rank}, opts) : at::empty({0}, opts);
  const int64_t* perm = rt.perm.data_ptr<int64_t>();
  std::vector<Task> tasks = make_tasks(rt.offsets, tile_rows);
  run_region(kRegFwd, static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const Task& tk = tasks[i];
    const int64_t b = tk.begin, m = tk.end - tk.begin, e = tk.expert;
    {
      KT_TIME(kGather);
      gather_rows(x, perm, k, b, tk.end, xs);
    }
    at::Tensor xs_t = xs.narrow(0, b, m);
    at::Tensor gu_t = gu.narrow(0, b, m);
    at::Tensor z_t = l.on ? z.narrow(0, b, m) : at::Tensor();
    gate_up_rows(xs_t, c, l, pl, e, gu_t, &z_t);
    at::Tensor h_t = at::empty({m, inter}, opts);
    {
      KT_TIME(kAct);
      act_fwd(gu_t, h_t, c.act);
    }
    at::Tensor o_t = out.narrow(0, b, m);
    {
      KT_TIME(kGemmDown);
      c.dn.nt(o_t, h_t, e);
      if (c.dn_bias.defined()) o_t.add_(c.dn_bias[e]);
    }
    if (l.on) {
      KT_TIME(kLoraDown);
      at::Tensor zd_t = zd.narrow(0, b, m);
      if (pl.on) {
        lora::nt(h_t, pl.a_down, e, zd_t, false, 1.0f);
        lora::nt(zd_t, pl.b_down, e, o_t, true, static_cast<float>(l.s));
      } else {
        at::mm_out(zd_t, h_t, l.a_down[e].t());
        o_t.addmm_(zd_t, l.b_down[e].t(), 1.0, l.s);
      }
    }
  });
  // Timed inside: scatter runs on torch's threads, which a timer here would not see.
  at::Tensor y = scatter(out, rt.pos, c.w, tokens, k, &g_phase_ns[kScatter]);
  std::vector<at::Tensor> saved = {rt.perm, rt.pos, rt.offsets};
  if (save) {
    saved.push_back(gu);
    saved.push_back(z);
    saved.push_back(zd);
  }
  return {y, saved};
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> backward(
    const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& ids_in,
    const at::Tensor& w_in, const std::string& format, const std::vector<at::Tensor>& gate_up,
    const std::vector<at::Tensor>& down, const std::optional<at::Tensor>& gate_up_bias,
    const std::optional<at::Tensor>& down_bias, int64_t num_experts, int64_t intermediate_size,
    int64_t activation, const std::vector<double>& activation_params,
    std::vector<at::Tensor> lora_t, double scaling, bool fused, std::vector<at::Tensor> saved,
    bool need_dx, int64_t tile_rows) {
  at::NoGradGuard no_grad;
  std::optional<Timer> setup_timer(std::in_place, kSetup);  // ends before the parallel region
  for (auto& t : lora_t) t = t.defined() ? t.detach() : t;
  const Call c = prepare(x_in, ids_in, w_in, format, gate_up, down, gate_up_bias, down_bias,
                         num_experts, intermediate_size, activation, activation_params, lora_t,
                         fused, tile_rows);
  TORCH_CHECK_VALUE(dy_in.defined() && dy_in.sizes() == c.x.sizes(),
                    "dy must have the shape of x ", c.x.sizes(), ", got ",
                    dy_in.defined() ? dy_in.sizes() : at::IntArrayRef{});
  TORCH_CHECK_TYPE(dy_in.scalar_type() == c.dt, "dy must be ", c.dt, ", got ",
                   dy_in.scalar_type());
  const at::Tensor dy = dy_in.detach().contiguous();
  const at::Tensor& x = c.x;
  const at::Tensor& w = c.w;
  const int64_t tokens = c.tokens, hidden = c.hidden, k = c.k, inter = c.inter;
  const int64_t num_e = c.experts;
  Lora l = prepare_lora(lora_t, fused, scaling, inter);
  Routing rt = check_saved_routing(saved, c, row_pad(c, l.on));
  const bool have_saved = saved.size() == 6;
  const PackedLora pl = pack_lora(l, c.dt, rt.offsets, !have_saved, true);
  const int64_t ra = l.on ? l.a_cat.size(1) : 0, r = l.rank;
  auto opts = x.options();
  const int64_t* perm = rt.perm.data_ptr<int64_t>();
  const int64_t np = rt.perm.numel();
  if (have_saved) {
    // saved[3] is read through raw row pointers (act_bwd): an expanded or strided view of
    // the right shape would be read past its storage.
    TORCH_CHECK_VALUE(saved[3].defined() && saved[3].sizes() == at::IntArrayRef({np, 2 * inter}) &&
                          saved[3].scalar_type() == c.dt && saved[3].is_contiguous() &&
                          saved[3].device().is_cpu(),
                      "saved[3] (gate_up pre-activations) must be a contiguous CPU ", c.dt,
                      " [", np, ", ", 2 * inter, "] tensor");
    if (l.on) {
      TORCH_CHECK_VALUE(saved[4].sizes() == at::IntArrayRef({np, ra}) &&
                            saved[5].sizes() == at::IntArrayRef({np, r}) &&
                            saved[4].scalar_type() == c.dt && saved[5].scalar_type() == c.dt,
                        "saved[4]/saved[5] (LoRA intermediates) do not match the LoRA rank");
    }
  }
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
  const auto dt = c.dt;
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
  setup_timer.reset();
  run_region(kRegBwd, static_cast<int64_t>(tasks.size()), [&](int64_t i) {
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
      gate_up_rows(xs.narrow(0, b, m), c, l, pl, e, gu_t, &z_t);
    }
    {
      KT_TIME(kGather);
      gather_rows(dy, perm, k, b, tk.end, dys);
    }
    at::Tensor dys_t = dys.narrow(0, b, m);
    at::Tensor gh_t = at::empty({m, inter}, opts);
    {
      KT_TIME(kBwdGemmDown);
      c.dn.nn(gh_t, dys_t, e);
    }
    if (l.on) {
      KT_TIME(kBwdLoraDown);
      at::Tensor q_t = q.narrow(0, b, m);
      if (pl.on) {
        lora::nt(dys_t, pl.b_down_t, e, q_t, false, 1.0f);
        lora::nt(q_t, pl.a_down_t, e, gh_t, true, static_cast<float>(l.s));
      } else {
        at::mm_out(q_t, dys_t, l.b_down[e]);
        gh_t.addmm_(q_t, l.a_down[e], 1.0, l.s);
      }
    }
    at::Tensor dgu_t = dgu.narrow(0, b, m);
    at::Tensor h_t = l.on ? h.narrow(0, b, m) : at::empty({m, inter}, opts);
    at::Tensor dw_t = dw_rows.narrow(0, b, m);
    {
      KT_TIME(kActBwd);
      act_bwd(gu_t, gh_t, w_rows.narrow(0, b, m), dgu_t, h_t, dw_t, c.act);
      // d topk_weights = <dy, expert output>; the down bias is part of that output.
      if (c.dn_bias.defined()) {
        dw_t.add_(at::mv(dys_t.to(w.scalar_type()), c.dn_bias[e].to(w.scalar_type())));
      }
    }
    if (l.on) {
      KT_TIME(kBwdLoraGateUp);
      at::Tensor zd_t = have_saved ? at::Tensor() : zd.narrow(0, b, m);
      at::Tensor dz_t = dz.narrow(0, b, m);
      if (pl.on) {
        if (!have_saved) lora::nt(h_t, pl.a_down, e, zd_t, false, 1.0f);
        lora::nt(dgu_t, pl.b_bd_t, e, dz_t, false, 1.0f);
      } else {
        if (!have_saved) at::mm_out(zd_t, h_t, l.a_down[e].t());
        at::mm_out(dz_t, dgu_t, l.b_bd[e]);
      }
    }
    if (need_dx) {
      KT_TIME(kBwdGemmGateUp);
      at::Tensor dxs_t = dxs.narrow(0, b, m);
      c.gu.nn(dxs_t, dgu_t, e);
      if (pl.on) {
        lora::nt(dz.narrow(0, b, m), pl.a_cat_t, e, dxs_t, true, static_cast<float>(l.s));
      } else if (l.on) {
        dxs_t.addmm_(dz.narrow(0, b, m), l.a_cat[e], 1.0, l.s);
      }
    }
  });

  std::vector<at::Tensor> grads;
  if (l.on) {
    // Weight gradients: one GEMM per row tile of an expert, summed in order (fixed reduction);
    // with the packed products, one fp32 sum over the expert's rows.
    // Timed on each thread: a timer around the region would see the calling thread only.
    std::optional<Timer> prep_timer(std::in_place, kWeightGrad);
    // lora::grad folds the routing weight in itself; ATen's GEMMs take it pre-multiplied.
    at::Tensor qw, zdw, w_f;
    if (pl.on) {
      w_f = w_rows.to(at::kFloat).contiguous();
    } else {
      const at::Tensor w_col = w_rows.to(opts.dtype()).unsqueeze(1);
      qw = q * w_col;    // dL/d(A_down h) / s, per row
      zdw = zd * w_col;  // routing weight folded into the down LoRA input
    }
    at::Tensor d_acat = at::zeros_like(l.a_cat);
    at::Tensor d_bbd = fused ? at::zeros_like(l.b_bd) : at::Tensor();
    at::Tensor d_bg = fused ? at::Tensor() : at::zeros({num_e, inter, r}, opts);
    at::Tensor d_bu = fused ? at::Tensor() : at::zeros({num_e, inter, r}, opts);
    at::Tensor d_ad = at::zeros_like(l.a_down);
    at::Tensor d_bd = at::zeros_like(l.b_down);
    const int64_t* off = rt.offsets.data_ptr<int64_t>();
    prep_timer.reset();
    run_region(kRegGrad, num_e, [&](int64_t e) {
      KT_TIME(kWeightGrad);
      at::Tensor d_bd_e = d_bd[e], d_ad_e = d_ad[e], d_acat_e = d_acat[e];
      at::Tensor d_bbd_e = fused ? d_bbd[e] : at::Tensor();
      at::Tensor d_bg_e = fused ? at::Tensor() : d_bg[e];
      at::Tensor d_bu_e = fused ? at::Tensor() : d_bu[e];
      if (pl.on) {
        const int64_t b = off[e], m = off[e + 1] - off[e];
        if (m == 0) return;
        const float s = static_cast<float>(l.s);
        at::Tensor dgu_t = dgu.narrow(0, b, m), z_t = z.narrow(0, b, m);
        const float* wf = w_f.data_ptr<float>() + b;
        lora::grad(zd.narrow(0, b, m), wf, dys.narrow(0, b, m), s, d_bd_e, true);
        lora::grad(q.narrow(0, b, m), wf, h.narrow(0, b, m), s, d_ad_e, false);
        if (fused) {
          lora::grad(z_t, nullptr, dgu_t, s, d_bbd_e, true);
        } else {
          lora::grad(z_t.narrow(1, 0, r), nullptr, dgu_t.narrow(1, 0, inter), s, d_bg_e, true);
          lora::grad(z_t.narrow(1, r, r), nullptr, dgu_t.narrow(1, inter, inter), s, d_bu_e, true);
        }
        lora::grad(dz.narrow(0, b, m), nullptr, xs.narrow(0, b, m), s, d_acat_e, false);
        return;
      }
      for (int64_t b = off[e]; b < off[e + 1]; b = common::tile_end(b, off[e + 1], tile_rows)) {
        const int64_t m = common::tile_end(b, off[e + 1], tile_rows) - b;
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
  at::Tensor dx = need_dx ? scatter(dxs, rt.pos, at::Tensor(), tokens, k, &g_phase_ns[kBwdScatter])
                          : at::empty({0}, opts);
  KT_TIME(kBwdScatter);
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
  KT_FEATURE("amx-bf16")
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

// Parallel-region statistics (see Region): "<region>.<field>", seconds (counts for calls and
// threads), summed over calls since the last reset.
std::vector<std::pair<std::string, double>> profile_regions(bool reset) {
  std::vector<std::pair<std::string, double>> out;
  for (int r = 0; r < kRegionCount; ++r) {
    for (int f = 0; f < kRegionFieldCount; ++f) {
      const int64_t v = g_region[r][f].load();
      out.emplace_back(std::string(kRegionNames[r]) + "." + kRegionFields[f],
                       f < 2 ? static_cast<double>(v) : v * 1e-9);
      if (reset) g_region[r][f] = 0;
    }
  }
  return out;
}

}  // namespace

namespace formats {
const std::string& int8_isa();
}  // namespace formats

}  // namespace kt_kernel

// The only binding style: every op lives in torch.ops.kt_kernel. The Python module
// kt_kernel._C exists only so that importing it loads this library (and its registrations).
TORCH_LIBRARY(kt_kernel, m) {
  m.def("forward", &kt_kernel::forward);
  m.def("backward", &kt_kernel::backward);
  m.def("dequantize_tile", &kt_kernel::dequantize_tile);
  m.def("project", &kt_kernel::project);
  m.def("set_gemv_rows", [](int64_t n) {
    kt_kernel::common::gemv_rows_setting().store(n >= 0 ? n : kt_kernel::common::kDefaultGemvRows);
  });
  // An int64 count narrowed to the int OpenMP takes would wrap; more threads than this is a
  // mistake (libgomp aborts the process when it cannot create them).
  m.def("set_num_threads", [](int64_t n) {
    TORCH_CHECK_VALUE(n <= kt_kernel::common::kMaxThreads, "set_num_threads: at most ",
                      kt_kernel::common::kMaxThreads, " threads, got ", n);
    kt_kernel::common::thread_override().store(n > 0 ? static_cast<int>(n) : 0);
  });
  m.def("gemv_rows", []() { return kt_kernel::common::gemv_rows(); });
  // 1 (or negative, the default): the kernel's bf16 LoRA products where the CPU has
  // AVX512_BF16; 0: ATen's.
  m.def("set_lora_products", [](int64_t on) {
    kt_kernel::lora::enabled_setting().store(on != 0);
  });
  // Whether bf16 LoRA products run on the kernel's own AVX512_BF16 routines here (else ATen's).
  m.def("lora_products", []() { return kt_kernel::lora::available(at::kBFloat16); });
  m.def("isa", []() { return std::string(kt_kernel::isa_name(kt_kernel::isa_level())); });
  m.def("int8_isa", []() { return kt_kernel::formats::int8_isa(); });
  // Whether the kernel's own AMX-BF16 tile products run here (KT_KERNEL_AMX=0 turns them off).
  m.def("amx", []() { return kt_kernel::has_amx(); });
  m.def("amx_int8", []() { return kt_kernel::has_amx_int8(); });
  m.def("formats", []() { return kt_kernel::formats::format_names(); });
  m.def("activations", []() { return kt_kernel::activation_names(); });
  m.def("cpu_features", []() { return kt_kernel::cpu_features(); });
  m.def("get_num_threads", []() { return static_cast<int64_t>(kt_kernel::common::kernel_threads()); });
  m.def("release_scratch", []() { kt_kernel::common::pool().clear(); });
  m.def("profile", [](bool reset) {
    std::vector<std::string> names;
    std::vector<double> secs;
    for (auto& [n, s] : kt_kernel::profile(reset)) {
      names.push_back(n);
      secs.push_back(s);
    }
    return std::make_tuple(names, secs);
  });
  // Parallel-region statistics (see Region): names "<region>.<field>", values in seconds
  // (counts for calls and threads), summed over calls since the last reset.
  m.def("profile_regions", [](bool reset) {
    std::vector<std::string> names;
    std::vector<double> vals;
    for (auto& [n, v] : kt_kernel::profile_regions(reset)) {
      names.push_back(n);
      vals.push_back(v);
    }
    return std::make_tuple(names, vals);
  });
  m.def("torch_version", []() { return std::string(TORCH_VERSION); });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kt-kernel native library; its ops are torch.ops.kt_kernel.*";
}
