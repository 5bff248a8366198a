// Routing, scheduling, scratch memory, base GEMMs over any weight format (formats.h) and the
// element-wise plumbing of the one expert op (moe_kernel.cpp). Everything here is inline.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include <time.h>

#include "elementwise.h"
#include "formats.h"

namespace kt_kernel {
namespace common {

// Thread CPU time, not wall time: on a shared machine it measures the work, not the waiting.
inline int64_t thread_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// ------------------------------------------------------------------------- scratch memory
// Activation-sized buffers reused across calls. Fresh multi-MiB allocations are mmapped and
// every first touch page-faults (serialising threads on the mm lock); reusing them avoids
// that. Buffers are taken out under a mutex and handed back when their Scratch dies, so
// concurrent calls never share one. What escapes to Python is pooled only through
// pooled_tensor, whose buffer comes back when the last reference dies.
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
  // Room for each MoE layer's saved pre-activations (pooled_tensor; up to 94 layers in the
  // supported families) besides a call's scratch: what it keeps is what the last step held at
  // once, and release_scratch() hands it back.
  static constexpr size_t kMaxFree = 128;
  std::mutex mu_;
  std::vector<at::Tensor> free_;
};

inline Pool& pool() {
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

// A [rows, cols] tensor of `dtype` over a pooled buffer that goes back to the pool when its
// last reference dies: for a tensor that leaves the call (saved for backward) yet is made anew
// every step. At T=2048 the saved gate_up pre-activations (50 MB) were a fresh mmap each step:
// 12,288 page faults.
inline at::Tensor pooled_tensor(int64_t rows, int64_t cols, at::ScalarType dtype) {
  const int64_t bytes = rows * cols * static_cast<int64_t>(c10::elementSize(dtype));
  if (bytes <= 0) return at::empty({rows, cols}, at::TensorOptions().dtype(dtype));
  auto* buf = new at::Tensor(pool().take(bytes));
  return at::from_blob(
      buf->data_ptr(), {rows, cols},
      [buf](void*) {
        pool().give(std::move(*buf));
        delete buf;
      },
      at::TensorOptions().dtype(dtype));
}

// ------------------------------------------------------------- base GEMMs over a format
// Elements per dequantised tile: 4 Mi (8 MiB of bf16; a whole 1536 x 2048 gate_up of a
// Qwen3-30B-A3B expert). Each oneDNN call has a fixed cost that dominates at few rows, and a
// loader streams whole source rows better than 600-column slices of them. Measured (thread
// CPU time, H=2048/I=768, 128 rows per expert and 4 rows per expert): 4 Mi tiles took the
// tile loaders' share from 37-57 ms to 19-30 ms per step of 16 experts and brought int8/int4/
// fp8 from 0.83-0.86x to 0.95-0.99x of the bf16 base at 128 rows; 256 Ki tiles were 1.4-1.8x
// slower than 1 Mi at 4 rows. Overridable for tuning and tests: KT_KERNEL_TILE_ELEMS
// (KT_INT8_TILE_ELEMS is still read).
inline int64_t tile_elems() {
  static const int64_t v = [] {
    const char* s = std::getenv("KT_KERNEL_TILE_ELEMS");
    if (!s) s = std::getenv("KT_INT8_TILE_ELEMS");
    const long long n = s ? std::atoll(s) : 0;
    return n >= 1024 ? static_cast<int64_t>(n) : int64_t{4 * 1024 * 1024};
  }();
  return v;
}

// Rows of a task up to which a format's small-row product (Format::gemv) replaces tile + GEMM.
// Overridable for tuning and tests: KT_KERNEL_GEMV_ROWS (0: never; read once) or
// set_gemv_rows() (torch.ops.kt_kernel.set_gemv_rows; a negative value restores the default).
constexpr int64_t kDefaultGemvRows = 24;
inline std::atomic<int64_t>& gemv_rows_setting() {
  static std::atomic<int64_t> v{[] {
    const char* s = std::getenv("KT_KERNEL_GEMV_ROWS");
    return s ? std::max<int64_t>(0, std::atoll(s)) : kDefaultGemvRows;
  }()};
  return v;
}
inline int64_t gemv_rows() { return gemv_rows_setting().load(std::memory_order_relaxed); }

// A per-thread scratch tile; only one is alive per thread at a time (dequantise, GEMM, next).
inline at::Tensor scratch_tile(int64_t rows, int64_t cols, at::ScalarType dt) {
  thread_local std::vector<char> buf;
  const size_t bytes = static_cast<size_t>(rows * cols) * c10::elementSize(dt);
  if (buf.size() < bytes) buf.resize(bytes);
  return at::from_blob(buf.data(), {rows, cols}, at::TensorOptions().dtype(dt));
}

// Tile extent along one axis: at most about tile_elems() elements per tile, split evenly
// (a multiple of 16) so no thin tail tile is left (e.g. 2048 columns -> 4 x 512, not
// 3 x 672 + 32: a thin GEMM costs nearly as much as a full one).
inline int64_t tile_extent(int64_t full, int64_t other) {
  const int64_t cap = std::max<int64_t>(16, tile_elems() / std::max<int64_t>(other, 1));
  const int64_t tiles = (full + cap - 1) / cap;
  const int64_t t = ((full + tiles - 1) / tiles + 15) / 16 * 16;
  return std::max<int64_t>(std::min(t, full), 1);
}

// One projection's frozen weights W [E, N, K] in some format: the two GEMMs the op needs.
// A format with a tile loader is read tile by tile through a per-thread scratch (no
// full-precision copy of an expert ever exists); the dense format is read in place.
struct Projection {
  const formats::Format* fmt = nullptr;
  std::vector<at::Tensor> parts;
  int64_t experts = 0, n = 0, k = 0;
  // Where the tile loader's thread CPU time is added (the profile's "dequantize"), or null.
  std::atomic<int64_t>* load_ns = nullptr;

  formats::ExpertView view(int64_t e) const {
    formats::ExpertView v{};
    v.n = n;
    v.k = k;
    for (size_t i = 0; i < parts.size(); ++i) {
      const at::Tensor& p = parts[i];
      v.part[i] = static_cast<const char*>(p.data_ptr()) + e * p.stride(0) * p.element_size();
      v.dims[i] = static_cast<int>(std::min<int64_t>(p.dim() - 1, 3));
      for (int d = 0; d < v.dims[i]; ++d) v.sizes[i][d] = p.size(d + 1);
    }
    return v;
  }

  // out [m, N] = in [m, K] @ W_e^T (row blocks of W_e).
  void nt(at::Tensor& out, const at::Tensor& in, int64_t e) const {
    if (fmt->load == nullptr) {
      at::mm_out(out, in, parts[0][e].t());
      return;
    }
    const auto dt = in.scalar_type();
    const formats::ExpertView v = view(e);
    if (small(in, out) && fmt->gemv(v, false, in.data_ptr(), in.stride(0), in.size(0), dt,
                                    out.data_ptr(), out.stride(0))) {
      return;
    }
    const int64_t nt = tile_extent(n, k);
    for (int64_t n0 = 0; n0 < n; n0 += nt) {
      const int64_t len = std::min(nt, n - n0);
      at::Tensor tile = scratch_tile(len, k, dt);
      load(v, n0, 0, len, k, dt, tile.data_ptr(), k);
      at::Tensor o = out.narrow(1, n0, len);
      at::mm_out(o, in, tile.t());
    }
  }

  // out [m, K] = in [m, N] @ W_e (column blocks of W_e): dx and the gradient into down's input.
  void nn(at::Tensor& out, const at::Tensor& in, int64_t e) const {
    if (fmt->load == nullptr) {
      at::mm_out(out, in, parts[0][e]);
      return;
    }
    const auto dt = in.scalar_type();
    const formats::ExpertView v = view(e);
    if (small(in, out) && fmt->gemv(v, true, in.data_ptr(), in.stride(0), in.size(0), dt,
                                    out.data_ptr(), out.stride(0))) {
      return;
    }
    const int64_t ct = tile_extent(k, n);
    for (int64_t c0 = 0; c0 < k; c0 += ct) {
      const int64_t len = std::min(ct, k - c0);
      at::Tensor tile = scratch_tile(n, len, dt);
      load(v, 0, c0, n, len, dt, tile.data_ptr(), len);
      at::Tensor o = out.narrow(1, c0, len);
      at::mm_out(o, in, tile);
    }
  }

 private:
  // Whether this product goes through the format's small-row routine (rows of unit stride).
  bool small(const at::Tensor& in, const at::Tensor& out) const {
    const int64_t limit = gemv_rows();
    const bool all_rows = limit > 0 && fmt->all_rows_here();
    return fmt->gemv != nullptr && (in.size(0) <= limit || all_rows) && in.stride(1) == 1 &&
           out.stride(1) == 1 && in.scalar_type() == out.scalar_type();
  }

  void load(const formats::ExpertView& v, int64_t row0, int64_t col0, int64_t rows,
            int64_t cols, at::ScalarType dt, void* out, int64_t ldo) const {
    const int64_t t0 = load_ns ? thread_ns() : 0;
    fmt->load(v, row0, col0, rows, cols, dt, out, ldo);
    if (load_ns) *load_ns += thread_ns() - t0;
  }
};

// Experts' rows start at a multiple of `pad` and are zero-padded to one (each op picks its
// own pad; see kPad there). Padding rows carry zero input and zero routing weight.
struct Routing {
  at::Tensor perm;     // [Np] flat (t*k + j) index of sorted row p, -1 for a padding row
  at::Tensor pos;      // [N] sorted row of flat index f
  at::Tensor offsets;  // [E+1] first sorted row of each expert (multiples of pad)
};

inline Routing route(const at::Tensor& ids, int64_t num_experts, int64_t pad) {
  const int64_t n = ids.numel();
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor offsets = at::zeros({num_experts + 1}, opts);
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t f = 0; f < n; ++f) {
    TORCH_CHECK_INDEX(id[f] >= 0 && id[f] < num_experts, "topk_ids must lie in [0, ", num_experts,
                      "), got id ", id[f]);
    off[id[f] + 1]++;
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    off[e + 1] = off[e] + (off[e + 1] + pad - 1) / pad * pad;
  }
  Routing r{at::full({off[num_experts]}, -1, opts), at::empty({n}, opts), offsets};
  std::vector<int64_t> fill(off, off + num_experts);
  int64_t* perm = r.perm.data_ptr<int64_t>();
  int64_t* pos = r.pos.data_ptr<int64_t>();
  // Stable: rows of one expert stay in token order, so the layout is a pure function of ids.
  for (int64_t f = 0; f < n; ++f) {
    const int64_t p = fill[id[f]]++;
    perm[p] = f;
    pos[f] = p;
  }
  return r;
}

struct Task {
  int64_t expert, begin, end;
};

// End of the row tile that starts at `b` (< limit): min(b + tile_rows, limit) without forming
// b + tile_rows, which wraps for a tile_rows near INT64_MAX (the op takes it from Python).
inline int64_t tile_end(int64_t b, int64_t limit, int64_t tile_rows) {
  return tile_rows >= limit - b ? limit : b + tile_rows;
}

// Tasks in descending size so dynamic scheduling balances the tail.
inline std::vector<Task> make_tasks(const at::Tensor& offsets, int64_t tile_rows) {
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t e_count = offsets.numel() - 1;
  std::vector<Task> tasks;
  for (int64_t e = 0; e < e_count; ++e) {
    for (int64_t b = off[e]; b < off[e + 1];) {
      const int64_t end = tile_end(b, off[e + 1], tile_rows);
      tasks.push_back({e, b, end});
      b = end;
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return (a.end - a.begin) > (b.end - b.begin);
  });
  return tasks;
}

// Threads of the kernel's parallel regions: set_num_threads(n > 0) (Python
// kt_kernel.set_num_threads), else KT_KERNEL_THREADS, else torch's intra-op count. The kernel's
// count is its own so that several processes sharing a machine can each take a slice of the
// cores without changing how many threads torch's own ops use.
constexpr int64_t kMaxThreads = 1024;  // set_num_threads' bound (an int64 from Python)
inline std::atomic<int>& thread_override() {
  static std::atomic<int> v{[] {
    const char* s = std::getenv("KT_KERNEL_THREADS");
    const long long n = s ? std::atoll(s) : 0;
    return n > 0 ? static_cast<int>(std::min<long long>(n, kMaxThreads)) : 0;
  }()};
  return v;
}

inline int kernel_threads() {
  const int n = thread_override().load(std::memory_order_relaxed);
  return n > 0 ? n : at::get_num_threads();
}

// Runs fn(i) for i in [0, n) on up to kernel_threads() threads. Inside, nested
// parallelism is switched off (ICV set to one thread) so every ATen/MKL/oneDNN call computes
// exactly as it would single-threaded: results do not depend on the thread count.
template <typename Fn>
inline void run_tasks(int64_t n, const Fn& fn) {
  if (n == 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(kernel_threads(), n));
  std::exception_ptr error;
  std::mutex mu;
#pragma omp parallel num_threads(threads)
  {
    omp_set_num_threads(1);
    at::NoGradGuard no_grad;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// The LoRA factors in the kernel's internal form: A_cat [E, ra, H] (gate and up A stacked for
// the split layout), B_bd [E, 2I, ra] (block-diagonal for split, B_gate_up for fused), and
// the down adapter.
struct Lora {
  bool on = false;
  bool fused = false;
  int64_t rank = 0;
  at::Tensor a_cat, b_bd, a_down, b_down;
  double s = 0;
};

inline Lora prepare_lora(const std::vector<at::Tensor>& t, bool fused, double scaling, int64_t inter) {
  Lora l;
  if (t.empty()) return l;
  l.on = true;
  l.fused = fused;
  l.s = scaling;
  if (fused) {
    TORCH_CHECK(t.size() == 4, "fused LoRA needs 4 tensors, got ", t.size());
    l.rank = t[0].size(1);
    l.a_cat = t[0].contiguous();
    l.b_bd = t[1].contiguous();
    l.a_down = t[2].contiguous();
    l.b_down = t[3].contiguous();
  } else {
    TORCH_CHECK(t.size() == 6, "split LoRA needs 6 tensors, got ", t.size());
    const int64_t r = t[0].size(1);
    l.rank = r;
    l.a_cat = at::cat({t[0], t[2]}, 1);
    l.b_bd = at::zeros({t[1].size(0), 2 * inter, 2 * r}, t[1].options());
    l.b_bd.narrow(1, 0, inter).narrow(2, 0, r).copy_(t[1]);
    l.b_bd.narrow(1, inter, inter).narrow(2, r, r).copy_(t[3]);
    l.a_down = t[4].contiguous();
    l.b_down = t[5].contiguous();
  }
  return l;
}

inline void gather_rows(const at::Tensor& src, const int64_t* perm, int64_t k, int64_t begin,
                 int64_t end, at::Tensor& dst) {
  const int64_t row_bytes = src.size(1) * src.element_size();
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  for (int64_t p = begin; p < end; ++p) {
    if (perm[p] < 0) {
      std::memset(d + p * row_bytes, 0, row_bytes);
    } else {
      std::memcpy(d + p * row_bytes, s + (perm[p] / k) * row_bytes, row_bytes);
    }
  }
}

inline void act_fwd(const at::Tensor& gu, at::Tensor& h, const Act& act) {
  const auto& kt = kernels();
  const int64_t rows = gu.size(0), inter = h.size(1);
  switch (gu.scalar_type()) {
    case at::kFloat:
      kt.act_fwd_f32(gu.data_ptr<float>(), h.data_ptr<float>(), rows, inter, act);
      break;
    case at::kDouble:
      kt.act_fwd_f64(gu.data_ptr<double>(), h.data_ptr<double>(), rows, inter, act);
      break;
    case at::kBFloat16:
      kt.act_fwd_bf16(reinterpret_cast<const uint16_t*>(gu.data_ptr()),
                      reinterpret_cast<uint16_t*>(h.data_ptr()), rows, inter, act);
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", gu.scalar_type());
  }
}

inline void act_bwd(const at::Tensor& gu, const at::Tensor& gh, const at::Tensor& w,
                    at::Tensor& dgu, at::Tensor& h, at::Tensor& dw, const Act& act) {
  const auto& kt = kernels();
  const int64_t rows = gu.size(0), inter = h.size(1);
  switch (gu.scalar_type()) {
    case at::kFloat:
      kt.act_bwd_f32(gu.data_ptr<float>(), gh.data_ptr<float>(), w.data_ptr<float>(),
                     dgu.data_ptr<float>(), h.data_ptr<float>(), dw.data_ptr<float>(), rows,
                     inter, act);
      break;
    case at::kDouble:
      kt.act_bwd_f64(gu.data_ptr<double>(), gh.data_ptr<double>(), w.data_ptr<double>(),
                     dgu.data_ptr<double>(), h.data_ptr<double>(), dw.data_ptr<double>(), rows,
                     inter, act);
      break;
    case at::kBFloat16:
      kt.act_bwd_bf16(reinterpret_cast<const uint16_t*>(gu.data_ptr()),
                      reinterpret_cast<const uint16_t*>(gh.data_ptr()), w.data_ptr<float>(),
                      reinterpret_cast<uint16_t*>(dgu.data_ptr()),
                      reinterpret_cast<uint16_t*>(h.data_ptr()), dw.data_ptr<float>(), rows,
                      inter, act);
      break;
    default:
      TORCH_CHECK(false, "unsupported dtype ", gu.scalar_type());
  }
}

// out[t] = sum_j w[t, j] * src[pos[t, j]] (w undefined: weight 1), tokens in parallel;
// each thread's CPU time is added to *cpu_ns when given (the profile).
inline at::Tensor scatter(const at::Tensor& src, const at::Tensor& pos, const at::Tensor& w,
                   int64_t tokens, int64_t k, std::atomic<int64_t>* cpu_ns = nullptr) {
  const int64_t hidden = src.size(1);
  at::Tensor out = at::empty({tokens, hidden}, src.options());
  const auto& kt = kernels();
  const int64_t* p = pos.data_ptr<int64_t>();
  at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
    const int64_t c0 = cpu_ns ? thread_ns() : 0;
    switch (src.scalar_type()) {
      case at::kFloat:
        kt.scatter_f32(src.data_ptr<float>(), p, w.defined() ? w.data_ptr<float>() : nullptr,
                       out.data_ptr<float>(), t0, t1, k, hidden);
        break;
      case at::kDouble:
        kt.scatter_f64(src.data_ptr<double>(), p, w.defined() ? w.data_ptr<double>() : nullptr,
                       out.data_ptr<double>(), t0, t1, k, hidden);
        break;
      case at::kBFloat16:
        kt.scatter_bf16(reinterpret_cast<const uint16_t*>(src.data_ptr()), p,
                        w.defined() ? w.data_ptr<float>() : nullptr,
                        reinterpret_cast<uint16_t*>(out.data_ptr()), t0, t1, k, hidden);
        break;
      default:
        TORCH_CHECK(false, "unsupported dtype ", src.scalar_type());
    }
    if (cpu_ns) *cpu_ns += thread_ns() - c0;
  });
  return out;
}

}  // namespace common

// Test-facing entries (format_ops.cpp), registered with the op: W_e[row0 : row0 + rows,
// col0 : col0 + cols] of every expert through the format's tile loader, and one expert's
// product as the op computes it.
at::Tensor dequantize_tile(const std::string& format, const std::vector<at::Tensor>& parts,
                           int64_t n, int64_t k, int64_t row0, int64_t col0, int64_t rows,
                           int64_t cols, at::ScalarType dtype);
at::Tensor project(const std::string& format, const std::vector<at::Tensor>& parts, int64_t n,
                   int64_t k, int64_t expert, const at::Tensor& in, bool nn);

}  // namespace kt_kernel
